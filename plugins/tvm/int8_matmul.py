"""CPU matmuls of packed weights on 8-bit activations (VNNI or AVX2).

A packed linear (`formats.FORMATS`) on the CPU multiplies integer codes by
8-bit activations, as llama.cpp does, instead of dequantizing every weight
to float32: `int8_activations.quantize_activations` cuts each row of x into blocks of 32,
scales each block by its largest magnitude into int8 (round to nearest) and
keeps the scale and each scale group's sum; `packed_matmul` then takes, for
16 output columns (one weight panel) and four consecutive inputs, the 64
code bytes side by side (the word orders `formats.py` documents), and adds
their products with four activations in one instruction: `vpdpbusd` with
AVX-512 VNNI, `vpmaddubsw` + `vpmaddwd` with AVX2 (the int16 sums of as
many groups of four inputs as fit, up to a scale group, sharing one
`vpmaddwd`: `int16_run`). Per scale group (32 inputs, 16 for Q6_K) the
integer sums turn into float32 once:

    y += a · dx · Σ q·x8  +  b · dx · Σ x8

where a and b are the group's scale and offset (Q4_0: d and −8d; Q4_1: d
and m; a K-quant: d·sc and −dmin·m; …) and dx the activations' block scale.
A K-quant in AVX2 code takes one activation scale per super-block of 256
instead (`activation_block`, llama.cpp's Q8_K): its integer sub-scale sc
multiplies the int16 sums in the `vpmaddwd` that widens them, and the
super-block's int32 total turns into float32 once, times d · dx; only the
offsets stay in float per group.
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
from lockgate.plugins.tvm.tir_vectors import LANES, bcast, f32, ramp, u8

#: rows computed together in prefill, by instruction set (AVX-512 has 32
#: vector registers, AVX2 16); see `row_tile`
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
        return self.parts[name][self.p, at, ramp(0, LANES)]

    def bytes(self, name: str, at) -> tirx.PrimExpr:
        """The 64 bytes of 16 outputs' words at `at`, as uint8x64."""
        return tirx.reinterpret("uint8x64", self._words(name, at))

    def codes(self, k8, half: int) -> tirx.PrimExpr:
        """The codes of inputs 8·k8 + 4·half … + 3 of the panel's 16
        outputs, as uint8x64 (int8x64 when `signed`)."""
        if self.fmt == "q8_0":
            if self.signed:
                return tirx.reinterpret("int8x64", self._words("codes", k8 * 2 + half))
            return self.bytes("codes", k8 * 2 + half) ^ u8(128)
        word = self.bytes("codes", k8)
        code = word & u8(15) if half == 0 else word >> u8(4)
        if self.fmt in ("q5_0", "q5_1", "q5_k"):
            shift = (k8 % 4) * 2 + half  # bit of the group in each byte
            high = self.bytes("high", k8 // 4)
            fifth = (high >> tirx.Broadcast(shift.astype("uint8"), 64)) & u8(1)
            code = code | (fifth << u8(4))
        elif self.fmt == "q6_k":
            shift = ((k8 % 2) * 2 + half) * 2
            high = self.bytes("high", k8 // 2)
            top = (high >> tirx.Broadcast(shift.astype("uint8"), 64)) & u8(3)
            code = code | (top << u8(4))
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

    def scale_pairs(self, g) -> list[tirx.PrimExpr]:
        """A K-quant group g's integer sub-scales as the int16 factors of a
        widening `vpmaddwd` (`_widen`): each output's scale twice, for
        outputs 0-7 and 8-15."""
        scales = tirx.Cast("int16x16", self._words("sub_scales", g))
        return [
            tirx.Shuffle([scales], [tirx.const(8 * h + i // 2, "int32") for i in range(16)]) for h in range(2)
        ]

    def super_scale(self, block) -> tirx.PrimExpr:
        """A K-quant super-block's float scale d (float32x16)."""
        return f32(self._words("super_scales", block))

    def scale_and_offset(self, g) -> tuple[tirx.PrimExpr, tirx.PrimExpr | None]:
        """Group g's scale a and offset b (float32x16; b None when zero)."""
        fmt = self.fmt
        if fmt in ("q4_k", "q5_k"):
            a = f32(self._words("super_scales", g // 8)) * f32(self._words("sub_scales", g))
            b = f32(self._words("super_mins", g // 8)) * f32(self._words("sub_mins", g))
            return a, -b
        if fmt == "q6_k":
            a = f32(self._words("super_scales", g // 16)) * f32(self._words("sub_scales", g))
            return a, a * bcast(tirx.const(-32.0, "float32"), LANES)
        d = f32(self._words("scales", g))
        if fmt in ("q4_1", "q5_1"):
            return d, f32(self._words("mins", g))
        centre = {"q4_0": -8.0, "q5_0": -16.0, "q8_0": None if self.signed else -128.0}[fmt]
        if centre is None:
            return d, None
        return d, d * bcast(tirx.const(centre, "float32"), LANES)


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
            tirx.reinterpret("int8x64", bcast(x4, 16)),
        )
    x32 = tirx.reinterpret("int8x32", bcast(x4, 8))
    ones = bcast(tirx.const(1, "int16"), 16)
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
        x32 = tirx.reinterpret("int8x32", bcast(x4, 8))
        pairs = tirx.call_llvm_pure_intrin(
            "int16x16", "llvm.x86.avx2.pmadd.ub.sw", tirx.reinterpret("int8x32", part), x32
        )
        sums = pairs if sums is None else sums + pairs
    return sums


def _widen(sums16, factors=None):
    """AVX2: int16 pair sums of 16 outputs (two int16x16, outputs 0-7 and
    8-15) added pairwise into int32x16 (`vpmaddwd` by ones, or by each
    output's integer sub-scale: `factors`, from `_Weights.scale_pairs`)."""
    ones = bcast(tirx.const(1, "int16"), 16)
    factors = factors or [ones, ones]
    halves = [
        tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", s, f) for s, f in zip(sums16, factors)
    ]
    return tirx.Shuffle(halves, [tirx.const(i, "int32") for i in range(16)])


#: K-quants: inputs per super-block (one float scale d per output)
SUPER_BLOCK = 256


def activation_layout(fmt: str, isa: str | None) -> tuple[int, int]:
    """`quantize_activations`' block and group for `fmt`'s kernel on `isa`:
    inputs per activation scale (`activation_block`) and per sum (the
    format's scale group, whose offset multiplies it)."""
    return activation_block(fmt, isa), _GROUP.get(fmt, 32)


def activation_block(fmt: str, isa: str | None) -> int:
    """Inputs per activation scale in `fmt`'s kernel on `isa`: with AVX2 a
    K-quant's super-block of 256, as llama.cpp's Q8_K, so the kernel folds
    the integer sub-scales into its widening `vpmaddwd` and turns the sums
    into float32 once per super-block rather than per group; otherwise 32."""
    if fmt in ("q4_k", "q5_k", "q6_k") and int16_run(isa, fmt):
        return SUPER_BLOCK
    return 32


def row_tile(isa: str, fmt: str) -> int:
    """The rows a prefill kernel computes together: `ROW_TILE`, except 8
    for a K-quant in AVX2 code, whose sub-scales folded into the integer
    sums (`activation_block`) leave no float work per group: its codes then
    unpack once for 8 rows, for a few spills (on 64 rows measured 4 % faster
    for Q4_K, 13 % Q6_K, 16 % Q5_K, where Q4_0 and Q4_1 lose 4 %)."""
    if activation_block(fmt, isa) == SUPER_BLOCK:
        return 8
    return ROW_TILE[isa]


def packed_matmul(
    fmt: str, k_extent: int, n_extent: int, row_tile: int, isa: str, prefetch_lines: int = PREFETCH_LINES
) -> tirx.PrimFunc:
    """y (rows, n) = x @ W for a paneled weight of packed format `fmt`,
    from `quantize_activations`' outputs laid out by
    `activation_layout(fmt, isa)`; `row_tile` rows share each unpacked panel
    of codes; the weight streams are prefetched `prefetch_lines` ahead (0:
    not at all). With a super-block per activation scale, the groups'
    integer sums are scaled by their sub-scales as they widen, added over
    the super-block, and turned into float32 once, times d and dx; only
    the offsets (mins) stay in float per group."""
    spec = FORMATS[fmt]
    group = _GROUP.get(fmt, 32)
    block = activation_block(fmt, isa)
    fold = block == SUPER_BLOCK
    panels = n_extent // LANES
    run = int16_run(isa, fmt)
    chains = 2 if row_tile == 1 and not run else 1
    rows = tirx.Var("rows", "int64")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x8 = T.arg("x8", T.buffer((rows, k_extent), "int8"))
            dx = T.arg("dx", T.buffer((rows, k_extent // block), "float32"))
            sums = T.arg("sums", T.buffer((rows, k_extent // group), "float32"))
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

                    def zero(buffer, count: int, dtype: str) -> None:
                        for r in range(count):
                            T.buffer_store(buffer, bcast(tirx.const(0, dtype), LANES), [ramp(r * LANES, LANES)])

                    def integer_sums(g, factors) -> None:
                        """Group g's integer sums into acci: set, or with
                        `factors` (its sub-scales) added to."""
                        if not run:
                            zero(acci, row_tile * chains, "int32")
                        for k8_in in range(group // 8):
                            k8 = g * (group // 8) + k8_in
                            for prefetch in weights.prefetch(k8, k8_in, prefetch_lines):
                                T.evaluate(prefetch)
                            codes = [weights.codes(k8, half) for half in range(2)]
                            for r in range(row_tile):
                                x4s = [
                                    tirx.reinterpret("int32", x8[row_of[r], ramp(k8 * 8 + half * 4, 4)])
                                    for half in range(2)
                                ]
                                if run:  # AVX2: int16 sums over `run` eights, then one widening
                                    for h in range(2):
                                        at = ramp((r * 2 + h) * 16, 16)
                                        sums = _pair_sums(codes, x4s, h)
                                        if k8_in % run:
                                            sums = acc16[at] + sums
                                        T.buffer_store(acc16, sums, [at])
                                    if k8_in % run == run - 1:
                                        at = ramp(r * chains * LANES, LANES)
                                        wide = _widen([acc16[ramp((r * 2 + h) * 16, 16)] for h in range(2)], factors)
                                        first = k8_in < run and not factors
                                        T.buffer_store(acci, wide if first else acci[at] + wide, [at])
                                    continue
                                for half in range(2):
                                    at = ramp((r * chains + (k8_in * 2 + half) % chains) * LANES, LANES)
                                    dot = _dot(isa, acci[at], codes[half], x4s[half], weights.signed)
                                    T.buffer_store(acci, dot, [at])

                    def add_to_rows(update) -> None:
                        """accf of each row r plus `update(r)` (skipped where None)."""
                        for r in range(row_tile):
                            value = update(r)
                            if value is not None:
                                at = ramp(r * LANES, LANES)
                                T.buffer_store(accf, accf[at] + value, [at])

                    def offsets(b, g, r):
                        """Row r's offset term of group g: b times dx times its activations' sum."""
                        if b is None:
                            return None
                        return b * bcast(sums[row_of[r], g], LANES)

                    def integer_total(r):
                        total = acci[ramp(r * chains * LANES, LANES)]
                        for chain in range(1, chains):
                            total = total + acci[ramp((r * chains + chain) * LANES, LANES)]
                        return f32(total)

                    zero(accf, row_tile, "float32")
                    if fold:
                        with T.serial(0, k_extent // block) as sb:
                            zero(acci, row_tile * chains, "int32")
                            with T.serial(0, block // group) as gi:
                                g = sb * (block // group) + gi
                                integer_sums(g, weights.scale_pairs(g))
                                _, b = weights.scale_and_offset(g)
                                add_to_rows(lambda r: offsets(b, g, r))
                            d = weights.super_scale(sb)
                            add_to_rows(lambda r: d * bcast(dx[row_of[r], sb], LANES) * integer_total(r))
                    else:
                        with T.serial(0, k_extent // group) as g:
                            integer_sums(g, None)
                            a, b = weights.scale_and_offset(g)

                            def group_update(r):
                                update = a * bcast(dx[row_of[r], g * group // 32], LANES) * integer_total(r)
                                offset = offsets(b, g, r)
                                return update if offset is None else update + offset

                            add_to_rows(group_update)
                    for r in range(row_tile):
                        with T.If(tile * row_tile + r < rows):
                            with T.Then():
                                T.buffer_store(
                                    y, accf[ramp(r * LANES, LANES)], [tile * row_tile + r, ramp(p * LANES, LANES)]
                                )
    return ib.get()
