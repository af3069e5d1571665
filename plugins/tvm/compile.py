"""Compile a model family's network (`families/`, built from `decoder.py`
and `layers.py`) for a target and cache the library on disk.

On `llvm`, `tvm.compile` alone applies neither fusion nor schedules, so the
relax pipeline is spelled out here, with `CPUMatmul`, a dlight-style rule for
the (in, out) matmuls that make up nearly all of the work.

On `cuda` every kernel gets a named rule (`cuda_rules`), recorded per kernel
in the manifest: `dl.gpu.GEMV` for the batch-1 decode (`decode_one`, static
batch), `dl.gpu.LowBatchGEMV` for batched decode and the prefill's LM head
(symbolic `batch_size`), `dl.gpu.Matmul` for prefill (symbolic
`num_tokens`), the dlight reduction rules for the norms and `GPUInjective`
for gathers and elementwise kernels; `dl.gpu.Fallback` is last and tests
check it schedules nothing. Prefill matmuls use tensor cores (WMMA, f16 in,
f32 accumulate) where schedule-time tensorization works, which
`tensorize_works` probes in a child process: with apache-tvm-ffi 0.1.15 every
`Schedule.tensorize` segfaults (it deep-copies the intrinsic through
`ffi::ToJSONGraph`, which crashes on any TVM 0.27 IR node; 0.1.14 works), and
then `Matmul` is scheduled under an sm_60 target so it takes its SIMT branch
(shared-memory tiles, no tensor cores). The decode functions are captured as
CUDA graphs (`RewriteCUDAGraph`), one capture per batch size the executor
calls them with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.analysis.common_analysis import collect_vars_used_in_prim_expr
from tvm.s_tir.dlight.base import ScheduleRule, try_inline_contiguous_spatial
from tvm.target import Target

from lockgate.models.config import ModelConfig

def default_cache_dir() -> pathlib.Path:
    """`$LOCKGATE_CACHE_DIR`, else `~/.cache/lockgate`."""
    env = os.environ.get("LOCKGATE_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "lockgate"


def resolve_target(name: str) -> Target:
    """Turn `ExecutorOptions.target` into a TVM target.

    "auto" picks cuda when a CUDA device is present, else the host CPU.
    """
    if name == "auto":
        name = "cuda" if tvm.cuda().exist else "llvm"
    if name == "llvm":
        # A target string with -mcpu is rejected by TVM 0.27; ask the device.
        return Target.from_device(tvm.cpu())
    if name == "cuda":
        if not tvm.cuda().exist:
            raise ValueError("target 'cuda' asked for, but no CUDA device is present")
        arch = "sm_" + tvm.cuda().compute_version.replace(".", "")
        return Target({"kind": "cuda", "arch": arch, "host": {"kind": "llvm"}})
    raise ValueError(f"unknown target {name!r}: expected 'auto', 'llvm' or 'cuda'")


def as_target(target: Target | dict | str) -> Target:
    """A Target from a Target, a config dict or a target name; a cuda dict
    without a host gets the generic llvm host."""
    if isinstance(target, Target):
        return target
    if isinstance(target, dict):
        if target.get("kind") == "cuda" and "host" not in target:
            target = {**target, "host": {"kind": "llvm"}}
        return Target(target)
    return resolve_target(target)


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


def _relax_pipeline(name: str, *, fuse: list, schedule, free_early: list, graphs: list = ()) -> tvm.transform.Pass:
    """Fuse, schedule with `schedule`, then lower for the VM. `fuse` runs
    before legalization; `graphs` right after memory planning; `free_early`
    between allocation lowering and builtin lowering."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        seq = tvm.transform.Sequential(
            [
                relax.backend.DispatchSampling(),
                relax.backend.DispatchSortScan(),
                *fuse,
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
                schedule,
                *vm_lowering(graphs=graphs, free_early=free_early),
            ]
        )
        return seq(mod)

    return _pipeline


def vm_lowering(*, graphs=(), free_early=()) -> list:
    """The passes from scheduled TIR to what the relax VM runs, shared by
    the model's pipelines and the sampler's: `graphs` run right after
    memory planning, `free_early` between allocation and builtin lowering."""
    return [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        *graphs,
        relax.transform.LowerAllocTensor(),
        *free_early,
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def cpu_pipeline() -> tvm.transform.Pass:
    """The relax pipeline for llvm.

    `KillAfterLastUse` is left out: `StaticPlanBlockMemory` already reuses
    storage, so dropping each tensor right after its last use saved no
    resident memory here, and it cost a VM call per tensor (about 850 per
    decode step, ~8 % of a batch-1 step).
    """
    return _relax_pipeline(
        "LockgateCPUPipeline",
        fuse=[],
        schedule=dl.ApplyDefaultSchedule(CPUMatmul(), dl.cpu.Reduction(), CPUInjective()),
        free_early=[],
    )


def cuda_pipeline(record: dict[str, str] | None = None, tensor_cores: bool = False) -> tvm.transform.Pass:
    """The relax pipeline for cuda: `cuda_rules` (noted in `record`), the
    decode functions rewritten to CUDA graphs (where the pass config
    `relax.backend.use_cuda_graph` is on), device memory freed right after
    its last use."""
    return _relax_pipeline(
        "LockgateCUDAPipeline",
        fuse=[relax.transform.FuseTransposeMatmul()],
        schedule=RecordedSchedule(cuda_rules(tensor_cores), {} if record is None else record),
        free_early=[relax.transform.KillAfterLastUse()],
        graphs=[relax.transform.RewriteCUDAGraph()],
    )


_SOURCE_FILES = ("layers.py", "decoder.py", "rope.py", "compile.py", "kernels.py")


def cache_key(
    config: ModelConfig,
    target: Target,
    formats: dict[str, str] | None = None,
    max_batch: int | None = None,
    network: type | None = None,
) -> str:
    """Hash of everything the compiled library depends on.

    Batch, page and chunk sizes are symbolic in the library, so they are not
    part of the key, except on CUDA the decode batch's upper bound
    (`max_batch`), which sizes the CUDA graphs' memory; the weight formats
    are, since each format compiles to its own dequantizing matmul, and so
    is the tvm-ffi version, which decides whether tensor cores are used.
    """
    import tvm_ffi

    here = pathlib.Path(__file__).parent
    h = hashlib.sha256()
    h.update(json.dumps(config.as_dict(), sort_keys=True).encode())
    h.update(json.dumps(formats or {}, sort_keys=True).encode())
    h.update(str(target).encode())
    h.update(tvm.__version__.encode())
    h.update(str(getattr(tvm_ffi, "__version__", "")).encode())
    if target.kind.name == "cuda":
        h.update(f"max_batch={max_batch}".encode())
    network = network or default_network()
    sources = [here / name for name in _SOURCE_FILES]
    sources.append(pathlib.Path(inspect.getsourcefile(network)))
    h.update(f"{network.__module__}.{network.__qualname__}".encode())
    for path in sources:
        if path.exists():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:24]


def default_network() -> type:
    """The network of a Llama, for callers that name none."""
    from lockgate.plugins.tvm.families.llama import LlamaForCausalLM

    return LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class CompiledModel:
    """A compiled library on disk and the parameters it expects."""

    library: pathlib.Path
    #: (name, shape) of each parameter, in the order the functions take them
    params: list[tuple[str, tuple[int, ...]]]
    target: Target
    #: True when the library came from the cache rather than a fresh compile
    cached: bool
    #: storage format of each linear module's weight (`weights.linear_formats`)
    formats: dict[str, str] = dataclasses.field(default_factory=dict)
    #: dtype of each parameter
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: on CUDA, the rule that scheduled each TIR function (`cuda_rules`)
    schedules: dict[str, str] = dataclasses.field(default_factory=dict)


def _write_atomically(path: pathlib.Path, write: Callable[[str], None], suffix: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: the decode batch's upper bound on CUDA when the caller names none
DEFAULT_MAX_BATCH = 256


def build_module(
    config: ModelConfig,
    target: Target,
    formats: dict[str, str] | None = None,
    max_batch: int | None = None,
    record: dict[str, str] | None = None,
    network: type | None = None,
):
    """Export the model and compile it: (relax Executable, named params).

    On CUDA `batch_decode` is told its batch never exceeds `max_batch`, so
    its memory is planned statically and the whole function becomes one
    CUDA graph; `record` receives the rule that scheduled each kernel.
    """
    model = (network or default_network())(config, target, formats)
    config_: dict = {}
    if target.kind.name == "llvm":
        from lockgate.plugins.tvm.kernels import cpu_attention_kernels

        with cpu_attention_kernels():
            mod, named_params = model.export_tvm(spec=model.export_spec())
        pipeline = cpu_pipeline()
    else:
        mod, named_params = model.export_tvm(spec=model.export_spec())
        bound = {"batch_size": int(max_batch or DEFAULT_MAX_BATCH)}
        gvar = mod.get_global_var("batch_decode")
        # The bound plans its memory statically; the capture hint lets
        # RewriteCUDAGraph capture it despite the symbolic batch, one graph
        # per batch size it is called with.
        mod[gvar] = mod[gvar].with_attrs(
            {
                "tir_var_upper_bound": bound,
                "relax.rewrite_cuda_graph.capture_symbolic_vars": ["batch_size"],
            }
        )
        pipeline = cuda_pipeline(record, tensorize_works())
        config_ = {"relax.backend.use_cuda_graph": True}
    # The CPU keeps the default pass context; CUDA's turns the graphs on.
    context = (
        tvm.transform.PassContext(config=config_) if config_ else contextlib.nullcontext()
    )
    with target, context:
        executable = tvm.compile(mod, target=target, relax_pipeline=pipeline)
    params = [(name, tuple(int(d) for d in p.shape)) for name, p in named_params]
    dtypes = {name: str(p.dtype) for name, p in named_params}
    return executable, params, dtypes


def compile_model(
    config: ModelConfig,
    target: Target,
    cache_dir: pathlib.Path | None = None,
    progress: Callable[[str], None] | None = None,
    formats: dict[str, str] | None = None,
    max_batch: int | None = None,
    network: type | None = None,
) -> CompiledModel:
    """The compiled library for (config, target, formats), from the cache or
    built now. On CUDA `max_batch` bounds the decode batch (default
    `DEFAULT_MAX_BATCH`).

    The library and its manifest are each written to a temporary file and
    renamed into place, so concurrent starts never read half a file; the
    manifest goes last and marks the entry complete.
    """
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    formats = dict(formats or {})
    if target.kind.name == "cuda":
        max_batch = int(max_batch or DEFAULT_MAX_BATCH)
    key = cache_key(config, target, formats, max_batch, network)
    library = cache_dir / f"lockgate-{key}.so"
    manifest = cache_dir / f"lockgate-{key}.json"
    if library.exists() and manifest.exists():
        try:
            entry = json.loads(manifest.read_text())
            params = [(n, tuple(s)) for n, s in entry["params"]]
            return CompiledModel(
                library,
                params,
                target,
                cached=True,
                formats=formats,
                dtypes=dict(entry["dtypes"]),
                schedules=dict(entry.get("schedules", {})),
            )
        except (ValueError, KeyError, TypeError):
            pass
    if progress is not None:
        progress(f"compiling for {target.kind.name}…")
    started = time.monotonic()
    schedules: dict[str, str] = {}
    executable, params, dtypes = build_module(config, target, formats, max_batch, schedules, network)
    _write_atomically(library, lambda tmp: executable.export_library(tmp), ".so")
    body = json.dumps(
        {
            "params": params,
            "dtypes": dtypes,
            "schedules": schedules,
            "target": str(target),
            "tvm": tvm.__version__,
        }
    )
    _write_atomically(manifest, lambda tmp: pathlib.Path(tmp).write_text(body), ".json")
    if progress is not None:
        progress(f"compiled for {target.kind.name} in {time.monotonic() - started:.1f} s")
    return CompiledModel(
        library, params, target, cached=False, formats=formats, dtypes=dtypes, schedules=schedules
    )
