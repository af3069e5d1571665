"""The schedule rules lowering the model's TIR: what each kernel runs as.

On `llvm`, `tvm.compile` alone applies neither fusion nor schedules, so the
CPU pipeline (`pipelines.cpu_pipeline`) applies `CPUMatmul`, a dlight-style
rule for the (in, out) matmuls that make up nearly all of the work, dlight's
CPU reduction rule and `CPUInjective`.

On `cuda` every kernel gets a named rule (`cuda_rules`), recorded per kernel
in the manifest (`RecordedSchedule`): `dl.gpu.GEMV` for the batch-1 decode
(`decode_one`, static batch), `dl.gpu.LowBatchGEMV` for batched decode and
the prefill's LM head (symbolic `batch_size`), `dl.gpu.Matmul` for prefill
(symbolic `num_tokens`), the dlight reduction rules for the norms and
`GPUInjective` for gathers and elementwise kernels; `dl.gpu.Fallback` is
last and tests check it schedules nothing. Prefill matmuls use tensor cores
(WMMA, f16 in, f32 accumulate) where schedule-time tensorization works,
which `tensorize_works` probes in a child process: with apache-tvm-ffi
0.1.15 every `Schedule.tensorize` segfaults (it deep-copies the intrinsic
through `ffi::ToJSONGraph`, which crashes on any TVM 0.27 IR node; 0.1.14
works), and then `Matmul` is scheduled under an sm_60 target so it takes its
SIMT branch (shared-memory tiles, no tensor cores).
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys
import tempfile

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.analysis.common_analysis import collect_vars_used_in_prim_expr
from tvm.s_tir.dlight.base import ScheduleRule, try_inline_contiguous_spatial
from tvm.target import Target


def rule_blocks(func, target: Target, kind: str = "llvm"):
    """A schedule of `func` and its blocks with contiguous spatial blocks
    inlined, as a schedule rule for targets of `kind` starts from; (None,
    None) where the rule does not apply (not a TIR function, another kind of
    target, blocks it cannot read)."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != kind:
        return None, None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None, None
    return sch, try_inline_contiguous_spatial(sch, infos)


class CPUMatmul(ScheduleRule):
    """Schedule `C[m…, n] (+)= A[m…, k] * B[k, n]` on the CPU.

    B is read along n, either a plain (in, out) matrix or the column panels
    of `model.Linear`. One reduction block with S…SR iterators gets an
    `m_inner × n_inner` register tile that accumulates over the whole of k,
    `n_inner` vectorized along B's contiguous rows and `m_inner` unrolled so
    each loaded B vector feeds several accumulators; threads split the
    output columns. Producers are inlined; injective epilogues (residual
    add, cast) fold into the write-back of the tile.

    The rows are tiled three ways:

    * pre-tiled (…, m_outer, m_inner) by the padded compute of
      `model._row_tiled_panel_matmul`: a 6×16 or 4×16 tile, 12 or 8 of
      AVX2's 16 vector registers;
    * static M: the largest of 4/3/2/1 rows that divides it;
    * symbolic M: one row and a 64-wide tile, rows looped inside each column
      block so B's panel stays in cache; splitting a symbolic M would mask
      the last tile, and the mask stops buffer compaction from shrinking the
      accumulator to registers.
    """

    def __init__(
        self, n_inner: int = 16, m_inner: int = 4, n_block: int = 64, n_inner_single_row: int = 64
    ) -> None:
        self.n_inner = n_inner
        self.m_inner = m_inner
        self.n_block = n_block
        self.n_inner_single_row = n_inner_single_row

    def _n_tiles(self, n_extent: int, n_inner: int) -> tuple[int, int]:
        """(n_block, n_inner) dividing N, so no lane of a vector is masked."""
        for inner in (n_inner, 32, 16, 8, 4):
            if n_extent % inner == 0:
                block = self.n_block
                while n_extent % block:
                    block //= 2
                return max(block, inner), inner
        return min(self.n_block, n_extent), min(n_inner, n_extent)

    def apply(self, func, target: Target, tunable: bool):
        sch, infos = rule_blocks(func, target)
        if infos is None:
            return None
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1:
            return None
        main = reductions[0]
        kinds = main.dom_kind()
        if kinds.count("R") != 1 or not kinds.endswith("R") or "O" in kinds or len(kinds) < 2:
            return None
        if not self._is_matmul(sch, main):
            return None
        epilogues = [b for b in infos if b is not main]
        if any(infos.index(e) < infos.index(main) for e in epilogues):
            return None
        n_extent = main.iters[-2].dom
        if not isinstance(n_extent, (int, tirx.IntImm)):
            return None
        n_extent = int(n_extent)

        block = main.block_rv
        local = sch.cache_write(block, 0, "local")
        for epi in epilogues:
            try:
                sch.reverse_compute_inline(epi.block_rv)
            except Exception:  # noqa: BLE001 - an epilogue that cannot fold stays a loop nest
                pass

        m_iters = main.iters[:-2]
        m_loops = [it.loop_rv for it in m_iters]
        n_loop, k_loop = main.iters[-2].loop_rv, main.iters[-1].loop_rv
        row_tile = self._row_tile(m_iters)
        static_m = all(isinstance(it.dom, (int, tirx.IntImm)) for it in m_iters)
        if row_tile:
            m_o = sch.fuse(*m_loops[:-1]) if len(m_loops) > 2 else m_loops[0]
            m_i = m_loops[-1]
            m_inner = row_tile
        else:
            if not m_loops:
                m_loop = sch.add_unit_loop(block)
            else:
                m_loop = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
            m_extent = 1
            for it in m_iters:
                m_extent = m_extent * int(it.dom) if static_m else 0
            if static_m:
                m_inner = next(f for f in (self.m_inner, 3, 2, 1) if m_extent % f == 0)
            else:
                m_inner = 1
            m_o, m_i = sch.split(m_loop, [None, m_inner])
        packed = self._reads_packed_codes(sch, main)
        single_row_inner = self.n_inner_single_row
        if packed:
            # Dequantizing takes a register per vector of codes besides its
            # accumulator: AVX2's 16 registers hold 4 of each without spills.
            single_row_inner = min(single_row_inner, 32)
        n_block, n_inner = self._n_tiles(
            n_extent, self.n_inner if m_inner > 1 else single_row_inner
        )
        n_o, n_mid, n_i = sch.split(n_loop, [None, n_block // n_inner, n_inner])
        if row_tile or static_m:
            sch.reorder(n_o, m_o, n_mid, k_loop, m_i, n_i)
            sch.reverse_compute_at(local, n_mid, preserve_unit_loops=True)
        else:
            sch.reorder(n_o, n_mid, m_o, k_loop, m_i, n_i)
            sch.reverse_compute_at(local, m_o, preserve_unit_loops=True)
        sch.parallel(n_o)
        sch.unroll(m_i)
        sch.vectorize(n_i)
        k_extent = main.iters[-1].dom
        if (
            packed
            and m_inner == 1
            and isinstance(k_extent, (int, tirx.IntImm))
            and int(k_extent) % 8 == 0
        ):
            # One row: eight k steps share a word of 4-bit codes, so unrolled
            # the word is loaded once and each shift is a constant (12 % on
            # a 576x3072 Q4_1 kernel). Row tiles already amortize the
            # dequantization over their rows, and there the longer body was
            # slower.
            k_loop, k_i = sch.split(k_loop, [None, 8])
            sch.unroll(k_i)
        elif (
            self._reads_quantized(sch, main)
            and isinstance(k_extent, (int, tirx.IntImm))
            and int(k_extent) % 32 == 0
        ):
            # A row tile of packed weights, or one row of Q8_0: k split at
            # blocks of 32, so the block's float16 scales (and K-quant sub-
            # and super-scales, high-bit words) are loaded and converted once
            # per block, out of the inner loop: 1.3-1.5x on 24 rows of
            # 576x1536 Q4_1, Q5_0 and Q4_K kernels, level with f16; one row
            # of Q8_0 28 -> 18 us, as fast as with float32 scales.
            k_loop, _ = sch.split(k_loop, [None, 32])
        sch.vectorize(sch.get_loops(local)[-1])
        # Loops are annotated before the init block is split off, so the
        # init block inherits them; its own inner loop is vectorized too.
        init = sch.decompose_reduction(block, k_loop)
        init_loops = sch.get_loops(init)
        sch.unroll(init_loops[-2])
        sch.vectorize(init_loops[-1])
        return sch

    @staticmethod
    def _row_tile(m_iters) -> int:
        """The static inner row extent of a row-tiled matmul, else 0."""
        if len(m_iters) < 2 or all(isinstance(it.dom, (int, tirx.IntImm)) for it in m_iters):
            return 0
        inner = m_iters[-1].dom
        if isinstance(inner, (int, tirx.IntImm)) and 2 <= int(inner) <= 8:
            return int(inner)
        return 0

    @staticmethod
    def _reads_packed_codes(sch: s_tir.Schedule, main) -> bool:
        """True when the block reads 4-bit codes packed in uint32 words."""
        return any(region.source.dtype == "uint32" for region in sch.get(main.block_rv).reads)

    @staticmethod
    def _reads_quantized(sch: s_tir.Schedule, main) -> bool:
        """True when the block reads packed codes (uint32 or int32 words)."""
        return any(str(region.source.dtype) in ("uint32", "int32") for region in sch.get(main.block_rv).reads)

    @staticmethod
    def _is_matmul(sch: s_tir.Schedule, main) -> bool:
        """True when some read depends on (k, n) and none of the M iterators."""
        stmt = sch.get(main.block_rv)
        m_vars = {it.var for it in main.iters[:-2]}
        n_var, k_var = main.iters[-2].var, main.iters[-1].var
        saw_weight = False
        for region in stmt.reads:
            used: set = set()
            for rng in region.region:
                used |= collect_vars_used_in_prim_expr(rng.min)
            if n_var in used and k_var in used and not (used & m_vars):
                saw_weight = True
        return saw_weight


class CPUInjective(ScheduleRule):
    """Parallelize an elementwise / injective kernel over its outer loops.

    The inner loop is left to LLVM's vectorizer; what matters at prefill
    sizes is that the (rows x columns) copies and activations are not run
    on one thread.
    """

    def apply(self, func, target: Target, tunable: bool):
        sch, infos = rule_blocks(func, target)
        if infos is None or len(infos) != 1 or not infos[0].is_injective():
            return None
        loops = sch.get_loops(infos[0].block_rv)
        if len(loops) < 2:
            return None
        outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        sch.parallel(outer)
        return sch


class GPUInjective(ScheduleRule):
    """Schedule a gather or elementwise kernel on the GPU.

    One injective block (after inlining contiguous producers): the loops
    are fused, the innermost elements (up to 8 bytes, dividing the static
    inner extent; CUDA codegen fails on the 16-byte half8 stores of a
    gather) are vectorized, and the rest is spread over 256 threads per
    block and as many blocks as needed. Several injective blocks under one
    loop nest (the KV cache's append, which writes K and V under one `if`
    on the page position) share the same thread mapping, unvectorized.
    """

    def apply(self, func, target: Target, tunable: bool):
        sch, infos = rule_blocks(func, target, "cuda")
        if not infos or not all(info.is_injective() for info in infos):
            return None
        block = infos[0].block_rv
        loops = sch.get_loops(block)
        if not loops:
            return None
        if len(infos) > 1:
            # one loop nest shared by every block, else not this rule's case
            for other in infos[1:]:
                theirs = sch.get_loops(other.block_rv)
                if len(theirs) != len(loops) or not all(
                    sch.get(a).same_as(sch.get(b)) for a, b in zip(loops, theirs)
                ):
                    return None
        vec = 1
        if len(infos) == 1:
            inner = infos[0].iters[-1].dom
            store = sch.get(block).writes[0].source
            lanes = max(1, 8 // max(1, tvm.DataType(store.dtype).bits // 8))
            if isinstance(inner, (int, tirx.IntImm)):
                while vec * 2 <= lanes and int(inner) % (vec * 2) == 0:
                    vec *= 2
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        if vec > 1:
            bx, tx, v = sch.split(fused, [None, 256, vec])
            sch.vectorize(v)
        else:
            bx, tx = sch.split(fused, [None, 256])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch


#: symbolic extents: `num_tokens` is a prefill chunk's rows, `batch_size` a
#: decode batch's (or a prefill's logit rows)
_PREFILL_VAR = "num_tokens"

#: the target `dl.gpu.Matmul` is shown when tensor cores cannot be used: it
#: takes its SIMT branch below sm_70, and the code is compiled for the real
#: architecture all the same
_SIMT_TARGET = {"kind": "cuda", "arch": "sm_60"}


def _symbolic_names(func: tirx.PrimFunc) -> set[str]:
    names = set()
    for param in func.params:
        for dim in getattr(param, "shape", None) or ():
            if isinstance(dim, tirx.Var):
                names.add(dim.name)
    return names


class GPUMatmul(ScheduleRule):
    """Route a matmul by its rows: a prefill's (`num_tokens`) to
    `dl.gpu.Matmul`, with tensor cores when `tensor_cores`, else its SIMT
    branch; a decode batch's (`batch_size`) to `dl.gpu.LowBatchGEMV`, which
    pads the batch to a multiple of `bucket`. `last` names the rule that
    scheduled the latest function (read by `RecordedSchedule`)."""

    def __init__(self, tensor_cores: bool, bucket: int = 4) -> None:
        self.tensor_cores = tensor_cores
        self.matmul = dl.gpu.Matmul()
        self.low_batch = dl.gpu.LowBatchGEMV(bucket)
        self.last = ""

    def apply(self, func, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        names = _symbolic_names(func)
        if _PREFILL_VAR in names:
            shown = target if self.tensor_cores else Target(_SIMT_TARGET)
            sch = self.matmul.apply(func, shown, tunable)
            if sch is not None:
                tensorized = any(i.kind.name == "Tensorize" for i in sch.trace.insts)
                self.last = "Matmul(tensor cores)" if tensorized else "Matmul(SIMT)"
            return sch
        sch = self.low_batch.apply(func, target, tunable)
        if sch is not None:
            self.last = "LowBatchGEMV"
        return sch


@tvm.transform.module_pass(opt_level=0, name="RecordedSchedule")
class RecordedSchedule:
    """`dl.ApplyDefaultSchedule` that notes which rule scheduled each
    function in `record` (function name -> rule name)."""

    def __init__(self, rules: list, record: dict[str, str]) -> None:
        self.rules = rules
        self.record = record

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updated = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
                if int(func.attrs["tirx.is_scheduled"]):
                    self.record[gvar.name_hint] = "hand-written"
                    continue
            target = func.attrs.get("target") if func.attrs is not None else None
            target = target or Target.current(allow_none=False)
            for rule in self.rules:
                sch = rule.apply(func, target, False)
                if sch is None:
                    continue
                if isinstance(sch, list):
                    sch = sch[0]
                self.record[gvar.name_hint] = getattr(rule, "last", "") or type(rule).__name__
                updated[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                break
            else:
                self.record[gvar.name_hint] = "unscheduled"
        for gvar, func in updated.items():
            mod[gvar] = func
        return mod


_TENSORIZE_PROBE = """
from tvm import s_tir, te
from tvm.script import tirx as T

@T.prim_func(s_tir=True)
def desc(a: T.Buffer((4,), "float16", offset_factor=1), c: T.Buffer((4,), "float16", offset_factor=1)):
    with T.sblock("root"):
        T.reads(a[0:4])
        T.writes(c[0:4])
        for i in range(4):
            with T.sblock("copy"):
                vi = T.axis.remap("S", [i])
                T.reads(a[vi])
                T.writes(c[vi])
                c[vi] = a[vi]

@T.prim_func(s_tir=True)
def impl(a: T.Buffer((4,), "float16", offset_factor=1), c: T.Buffer((4,), "float16", offset_factor=1)):
    with T.sblock("root"):
        T.reads(a[0:4])
        T.writes(c[0:4])
        T.evaluate(T.call_extern("int32", "copy4", c.data, a.data))

s_tir.TensorIntrin.register("lockgate_probe_copy4", desc, impl)
a = te.placeholder((8,), "float16", name="a")
b = te.compute((8,), lambda i: a[i], name="b")
sch = s_tir.Schedule(te.create_prim_func([a, b]))
_, inner = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 4])
sch.tensorize(inner, "lockgate_probe_copy4")
"""


@functools.lru_cache(maxsize=1)
def tensorize_works() -> bool:
    """Whether `Schedule.tensorize` survives in this installation, tried on
    a trivial intrinsic in a child process (a crash there would kill this
    one). Any tensorization crashes with apache-tvm-ffi 0.1.15.post2 (see
    the module docstring), whatever the intrinsic."""
    # TVMScript parses its functions' source, so the probe is a file, not `-c`.
    with tempfile.TemporaryDirectory(prefix="lockgate-probe-") as tmp:
        script = pathlib.Path(tmp) / "tensorize_probe.py"
        script.write_text(_TENSORIZE_PROBE + "\nprint('tensorized')\n")
        try:
            done = subprocess.run(
                [sys.executable, str(script)], capture_output=True, timeout=300, cwd=tmp
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0 and b"tensorized" in done.stdout


def cuda_rules(tensor_cores: bool) -> list:
    """The CUDA schedule rules, in the order they are tried."""
    return [
        dl.gpu.GEMV(),
        GPUMatmul(tensor_cores),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        GPUInjective(),
        dl.gpu.Fallback(),
    ]
