"""CPU matmuls of packed weights on 8-bit activations (VNNI or AVX2).

A packed linear (`formats.FORMATS`) on the CPU multiplies integer codes by
8-bit activations, as llama.cpp does, instead of dequantizing every weight
to float32: `quantize_activations` cuts each row of x into blocks of 32,
scales each block by its largest magnitude into int8 (round to nearest) and
keeps the scale and the block's sums; `packed_matmul` then takes, for 16
output columns (one weight panel) and four consecutive inputs, the 64 code
bytes side by side (the word orders `formats.py` documents), and adds their
products with four activations in one instruction: `vpdpbusd` with AVX-512
VNNI, `vpmaddubsw` + `vpmaddwd` with AVX2 (the int16 sums of as many groups
of four inputs as fit, up to a scale group, sharing one `vpmaddwd`:
`int16_run`). Per scale group (32 inputs, 16
for Q6_K) the integer sums turn into float32 once:

    y += a · dx · Σ q·x8  +  b · dx · Σ x8

where a and b are the group's scale and offset (Q4_0: d and −8d; Q4_1: d
and m; a K-quant: d·sc and −dmin·m; …) and dx the activations' block scale.
The result differs from the exact product by the activations' rounding
(about 0.4 % of a block's largest value), as llama.cpp's does; the float32
path (`layers.Linear` with `int8=None`) stays exact.

Both kernels are written directly in TIR (the IR builder), not scheduled:
the accumulators of a tile of rows stay in registers, the codes of a panel
are unpacked once per tile, and the output is written without padding.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.target import Target
from tvm.target.codegen import target_has_features
from tvm.tirx.script.builder import ir as T

from lockgate.plugins.tvm.formats import FORMATS

#: output columns per weight panel: one 512-bit vector of int32 sums
LANES = 16

#: rows computed together in prefill and in batched decode, by instruction set
#: (AVX-512 has 32 vector registers, AVX2 16)
ROW_TILE = {"avx512vnni": 8, "avx2": 4}

#: the scale group: inputs sharing one scale and offset
_GROUP = {"q6_k": 16}

#: how far ahead of the kernel's reads the weight streams are prefetched, in
#: 64-byte lines of each stream (2 KiB): the hardware prefetcher alone left a
#: batch-1 Q4_K matmul at 35 GB/s of a 42 GB/s machine, prefetching took it
#: to 38-43 (`benchmarks/int8_kernels.py --stream`)
PREFETCH_LINES = 32

#: the parts that stream one 64-byte line per 16 outputs of a word (the rest,
#: scales and mins, are a few bytes per 32 inputs and ride along)
_STREAMS = ("codes", "high")


def int8_isa(target: Target) -> str | None:
    """The instruction set the 8-bit kernels use on `target`, or None where
    they cannot run (not x86, or without AVX2)."""
    if target.kind.name != "llvm":
        return None
    if target_has_features("avx512vnni", target) and target_has_features("avx512bw", target):
        return "avx512vnni"
    if target_has_features("avx2", target):
        return "avx2"
    return None


def runs_int8(fmt: str, in_features: int, out_features: int) -> bool:
    """True when a weight of `fmt` and this shape has an 8-bit kernel."""
    return fmt in FORMATS and out_features % LANES == 0 and in_features % 32 == 0


def _ramp(start, lanes: int):
    return tirx.Ramp(start, 1, lanes)


def _bcast(value, lanes: int):
    return tirx.Broadcast(value, lanes)


def _u8(value: int):
    return _bcast(tirx.const(value, "uint8"), 64)


def _f32(expr, lanes: int = LANES):
    return tirx.Cast(f"float32x{lanes}", expr)


def _halves(vec, lanes: int):
    half = lanes // 2
    lo = tirx.Shuffle([vec], [tirx.const(i, "int32") for i in range(half)])
    hi = tirx.Shuffle([vec], [tirx.const(i, "int32") for i in range(half, lanes)])
    return lo, hi, half


def _reduce(combine, vec, lanes: int):
    """A vector's lanes folded pairwise with `combine` into one value."""
    while lanes > 1:
        lo, hi, lanes = _halves(vec, lanes)
        vec = combine(lo, hi)
    return vec


def quantize_activations(k_extent: int) -> tirx.PrimFunc:
    """x (rows, k) float32 -> x8 (rows, k) int8, dx (rows, k / 32) the
    blocks' scales, s16 (rows, k / 16) each 16 inputs' sum of x8 times dx.
    A block is one 32-lane vector: its largest magnitude and sums are folded
    from it in registers."""
    rows = tirx.Var("rows", "int64")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.arg("x", T.buffer((rows, k_extent), "float32"))
            x8 = T.arg("x8", T.buffer((rows, k_extent), "int8"))
            dx = T.arg("dx", T.buffer((rows, k_extent // 32), "float32"))
            s16 = T.arg("s16", T.buffer((rows, k_extent // 16), "float32"))
            with T.sblock("root"), T.parallel(0, rows) as r:
                with T.serial(0, k_extent // 32) as b:
                    block = x[r, _ramp(b * 32, 32)]
                    amax = _reduce(T.max, T.abs(block), 32)
                    inverse = T.Select(
                        amax > tirx.const(0.0, "float32"),
                        tirx.const(127.0, "float32") / amax,
                        tirx.const(0.0, "float32"),
                    )
                    codes = tirx.Cast("int32x32", T.round(block * _bcast(inverse, 32)))
                    T.buffer_store(x8, tirx.Cast("int8x32", codes), [r, _ramp(b * 32, 32)])
                    scale = amax / tirx.const(127.0, "float32")
                    T.buffer_store(dx, scale, [r, b])
                    lo, hi, _ = _halves(codes, 32)
                    for h, half in enumerate((lo, hi)):
                        total = _reduce(lambda a, c: a + c, half, 16)
                        T.buffer_store(s16, scale * total.astype("float32"), [r, b * 2 + h])
    return ib.get()


class _Weights:
    """How one format's codes, scales and offsets are read from panel `p` of
    its paneled parts (`P`, in / per, 16) inside the kernel, as vector
    expressions.

    Codes are unsigned bytes, the offset b taking out their centre, except
    Q8_0's with AVX2: its signed codes are multiplied as they are (`_dot`),
    where VNNI takes them biased by 128 like any other unsigned code."""

    def __init__(self, fmt: str, parts: dict, p, isa: str) -> None:
        self.fmt = fmt
        self.parts = parts
        self.p = p
        self.signed = fmt == "q8_0" and isa != "avx512vnni"

    def _words(self, name: str, at) -> tirx.PrimExpr:
        return self.parts[name][self.p, at, _ramp(0, LANES)]

    def bytes(self, name: str, at) -> tirx.PrimExpr:
        """The 64 bytes of 16 outputs' words at `at`, as uint8x64."""
        return tirx.reinterpret("uint8x64", self._words(name, at))

    def codes(self, k8, half: int) -> tirx.PrimExpr:
        """The codes of inputs 8·k8 + 4·half … + 3 of the panel's 16
        outputs, as uint8x64 (int8x64 when `signed`)."""
        if self.fmt == "q8_0":
            if self.signed:
                return tirx.reinterpret("int8x64", self._words("codes", k8 * 2 + half))
            return self.bytes("codes", k8 * 2 + half) ^ _u8(128)
        word = self.bytes("codes", k8)
        code = word & _u8(15) if half == 0 else word >> _u8(4)
        if self.fmt in ("q5_0", "q5_1", "q5_k"):
            shift = (k8 % 4) * 2 + half  # bit of the group in each byte
            high = self.bytes("high", k8 // 4)
            fifth = (high >> tirx.Broadcast(shift.astype("uint8"), 64)) & _u8(1)
            code = code | (fifth << _u8(4))
        elif self.fmt == "q6_k":
            shift = ((k8 % 2) * 2 + half) * 2
            high = self.bytes("high", k8 // 2)
            top = (high >> tirx.Broadcast(shift.astype("uint8"), 64)) & _u8(3)
            code = code | (top << _u8(4))
        return code

    def prefetch(self, k8, k8_in: int, lines: int) -> list[tirx.PrimExpr]:
        """Prefetches of the lines `lines` ahead of those holding
        inputs 8·k8 … 8·k8 + 7 (the `k8_in`-th eight of a scale group) in
        each weight stream; past the panel's end they fall in the next
        panel, which is read next."""
        out = []
        for part in FORMATS[self.fmt].parts:
            if part.name not in _STREAMS or lines == 0:
                continue
            if part.per <= 8:  # one or more words per eight inputs
                starts = [k8 * (8 // part.per) + j for j in range(8 // part.per)]
            else:  # one word per per/8 eights, groups starting on a word
                starts = [k8 // (part.per // 8)] if k8_in % (part.per // 8) == 0 else []
            for at in starts:
                line = T.address_of(self.parts[part.name][self.p, at + lines, 0])
                out.append(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", line, 0, 3, 1))
        return out

    def scale_and_offset(self, g) -> tuple[tirx.PrimExpr, tirx.PrimExpr | None]:
        """Group g's scale a and offset b (float32x16; b None when zero)."""
        fmt = self.fmt
        if fmt in ("q4_k", "q5_k"):
            a = _f32(self._words("super_scales", g // 8)) * _f32(self._words("sub_scales", g))
            b = _f32(self._words("super_mins", g // 8)) * _f32(self._words("sub_mins", g))
            return a, -b
        if fmt == "q6_k":
            a = _f32(self._words("super_scales", g // 16)) * _f32(self._words("sub_scales", g))
            return a, a * _bcast(tirx.const(-32.0, "float32"), LANES)
        d = _f32(self._words("scales", g))
        if fmt in ("q4_1", "q5_1"):
            return d, _f32(self._words("mins", g))
        centre = {"q4_0": -8.0, "q5_0": -16.0, "q8_0": None if self.signed else -128.0}[fmt]
        if centre is None:
            return d, None
        return d, d * _bcast(tirx.const(centre, "float32"), LANES)


def _dot(isa: str, acc, codes, x4, signed: bool):
    """acc (int32x16) plus, per lane, the sum of four code bytes (unsigned,
    or with AVX2 `signed`) times the four activation bytes of x4 (an int32
    holding them)."""
    if isa == "avx512vnni":
        return tirx.call_llvm_pure_intrin(
            "int32x16",
            "llvm.x86.avx512.vpdpbusd.512",
            acc,
            tirx.reinterpret("int8x64", codes),
            tirx.reinterpret("int8x64", _bcast(x4, 16)),
        )
    x32 = tirx.reinterpret("int8x32", _bcast(x4, 8))
    ones = _bcast(tirx.const(1, "int16"), 16)
    halves = []
    for h in range(2):
        part = tirx.Shuffle([codes], [tirx.const(i, "int32") for i in range(32 * h, 32 * h + 32)])
        if signed:  # |w| times x with w's sign: pair sums stay within int16
            xs = tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", x32, part)
            part = T.abs(part)
        else:
            xs = x32
        pairs = tirx.call_llvm_pure_intrin(
            "int16x16", "llvm.x86.avx2.pmadd.ub.sw", tirx.reinterpret("int8x32", part), xs
        )
        halves.append(tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, ones))
    both = tirx.Shuffle(halves, [tirx.const(i, "int32") for i in range(16)])
    return acc + both


#: the largest unsigned code of the formats wider than four bits
_CODE_MAX = {"q5_0": 31, "q5_1": 31, "q5_k": 31, "q6_k": 63}


def int16_run(isa: str, fmt: str) -> int:
    """AVX2: how many consecutive eights of inputs may add their int16 pair
    sums (`vpmaddubsw` of the codes and the activations) before one widening
    `vpmaddwd` into int32 — four products of a code of at most `c` and an
    activation of at most 127 per eight, so 32767 // (4 · 127 · c) of them,
    at most a scale group: 4 for 4-bit codes (a whole group of 32), 2 for
    5-bit, 1 for Q6_K; 0 where the kernels do not (VNNI, and Q8_0's signed
    codes)."""
    if isa != "avx2" or fmt == "q8_0":
        return 0
    return min(32767 // (4 * 127 * _CODE_MAX.get(fmt, 15)), _GROUP.get(fmt, 32) // 8)


def _pair_sums(codes, x4s, h: int):
    """AVX2: the int16 pair sums of outputs 8h … 8h + 7 for one eight of
    inputs: the codes of its two groups of four (`codes[g]`, 16 outputs'
    bytes) times the activations in `x4s[g]`, added."""
    sums = None
    for group, x4 in zip(codes, x4s):
        part = tirx.Shuffle([group], [tirx.const(i, "int32") for i in range(32 * h, 32 * h + 32)])
        x32 = tirx.reinterpret("int8x32", _bcast(x4, 8))
        pairs = tirx.call_llvm_pure_intrin(
            "int16x16", "llvm.x86.avx2.pmadd.ub.sw", tirx.reinterpret("int8x32", part), x32
        )
        sums = pairs if sums is None else sums + pairs
    return sums


def _widen(sums16):
    """AVX2: int16 pair sums of 16 outputs (two int16x16, outputs 0-7 and
    8-15) added pairwise into int32x16 (`vpmaddwd` by ones)."""
    ones = _bcast(tirx.const(1, "int16"), 16)
    halves = [tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", s, ones) for s in sums16]
    return tirx.Shuffle(halves, [tirx.const(i, "int32") for i in range(16)])


def packed_matmul(
    fmt: str, k_extent: int, n_extent: int, row_tile: int, isa: str, prefetch_lines: int = PREFETCH_LINES
) -> tirx.PrimFunc:
    """y (rows, n) = x @ W for a paneled weight of packed format `fmt`,
    from `quantize_activations`' outputs; `row_tile` rows share each
    unpacked panel of codes; the weight streams are prefetched
    `prefetch_lines` ahead (0: not at all)."""
    spec = FORMATS[fmt]
    group = _GROUP.get(fmt, 32)
    panels = n_extent // LANES
    chains = 2 if row_tile == 1 else 1
    run = int16_run(isa, fmt)
    rows = tirx.Var("rows", "int64")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x8 = T.arg("x8", T.buffer((rows, k_extent), "int8"))
            dx = T.arg("dx", T.buffer((rows, k_extent // 32), "float32"))
            s16 = T.arg("s16", T.buffer((rows, k_extent // 16), "float32"))
            parts = {
                part.name: T.arg(part.name, T.buffer((panels, k_extent // part.per, LANES), part.dtype))
                for part in spec.parts
            }
            y = T.arg("y", T.buffer((rows, n_extent), "float32"))
            with T.sblock("root"), T.parallel(0, panels) as p:
                weights = _Weights(fmt, parts, p, isa)
                with T.serial(0, (rows + row_tile - 1) // row_tile) as tile:
                    accf = T.alloc_buffer((row_tile * LANES,), "float32", scope="global")
                    # a row's sums of one group in `chains` independent
                    # accumulators: one chain of 8 dependent dot products
                    # waits on each one's latency when few rows interleave
                    acci = T.alloc_buffer((row_tile * chains * LANES,), "int32", scope="global")
                    # AVX2: each row's int16 pair sums of outputs 0-7 and 8-15 (`int16_run`)
                    acc16 = T.alloc_buffer((row_tile * 2 * 16,), "int16", scope="global")
                    row_of = [T.min(tile * row_tile + r, rows - 1) for r in range(row_tile)]
                    for r in range(row_tile):
                        T.buffer_store(accf, _bcast(tirx.const(0.0, "float32"), LANES), [_ramp(r * LANES, LANES)])
                    with T.serial(0, k_extent // group) as g:
                        for r in range(0 if run else row_tile * chains):
                            T.buffer_store(acci, _bcast(tirx.const(0, "int32"), LANES), [_ramp(r * LANES, LANES)])
                        for k8_in in range(group // 8):
                            k8 = g * (group // 8) + k8_in
                            for prefetch in weights.prefetch(k8, k8_in, prefetch_lines):
                                T.evaluate(prefetch)
                            codes = [weights.codes(k8, half) for half in range(2)]
                            for r in range(row_tile):
                                x4s = [
                                    tirx.reinterpret("int32", x8[row_of[r], _ramp(k8 * 8 + half * 4, 4)])
                                    for half in range(2)
                                ]
                                if run:  # AVX2: int16 sums over `run` eights, then one widening
                                    for h in range(2):
                                        at = _ramp((r * 2 + h) * 16, 16)
                                        sums = _pair_sums(codes, x4s, h)
                                        if k8_in % run:
                                            sums = acc16[at] + sums
                                        T.buffer_store(acc16, sums, [at])
                                    if k8_in % run == run - 1:
                                        at = _ramp(r * chains * LANES, LANES)
                                        wide = _widen([acc16[_ramp((r * 2 + h) * 16, 16)] for h in range(2)])
                                        T.buffer_store(acci, wide if k8_in < run else acci[at] + wide, [at])
                                    continue
                                for half in range(2):
                                    at = _ramp((r * chains + (k8_in * 2 + half) % chains) * LANES, LANES)
                                    dot = _dot(isa, acci[at], codes[half], x4s[half], weights.signed)
                                    T.buffer_store(acci, dot, [at])
                        a, b = weights.scale_and_offset(g)
                        for r in range(row_tile):
                            scale = dx[row_of[r], g * group // 32]
                            if group == 16:
                                sums = s16[row_of[r], g]
                            else:
                                sums = s16[row_of[r], g * 2] + s16[row_of[r], g * 2 + 1]
                            sums_i = acci[_ramp(r * chains * LANES, LANES)]
                            for chain in range(1, 1 if run else chains):
                                sums_i = sums_i + acci[_ramp((r * chains + chain) * LANES, LANES)]
                            update = a * _bcast(scale, LANES) * _f32(sums_i)
                            if b is not None:
                                update = update + b * _bcast(sums, LANES)
                            acc = accf[_ramp(r * LANES, LANES)]
                            T.buffer_store(accf, acc + update, [_ramp(r * LANES, LANES)])
                    for r in range(row_tile):
                        with T.If(tile * row_tile + r < rows):
                            with T.Then():
                                T.buffer_store(
                                    y, accf[_ramp(r * LANES, LANES)], [tile * row_tile + r, _ramp(p * LANES, LANES)]
                                )
    return ib.get()
