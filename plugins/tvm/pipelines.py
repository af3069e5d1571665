"""The relax pipelines: fusion, the schedule rules of `schedules.py`, and
the lowering to what the relax VM runs, per target; `vm_lowering` is shared
with the sampler's pipeline. The CUDA pipeline captures the decode
functions as CUDA graphs (`RewriteCUDAGraph`), one capture per batch size
the executor calls them with.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from lockgate.plugins.tvm.schedules import CPUInjective, CPUMatmul, RecordedSchedule, cuda_rules


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
