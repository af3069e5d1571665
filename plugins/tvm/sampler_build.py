"""The sampler compiled: its kernels (`sampler_kernels.sampler_module`)
scheduled for the CPU (each row on a thread) or the GPU (one thread block
per row of a `[batch, vocab]` reduction, `GPUInjective` for the rest) and
lowered for the VM. `build_sampler` is what `sampler.py` calls on a miss
of the compile cache."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from lockgate.plugins.tvm import tvmscript_stack
from lockgate.plugins.tvm.pipelines import vm_lowering
from lockgate.plugins.tvm.sampler_kernels import GPU_THREADS, sampler_module
from lockgate.plugins.tvm.schedules import GPUInjective, rule_blocks


class _CPURows(ScheduleRule):
    """Run every block's outer (batch) loop across threads on the CPU."""

    def apply(self, func, target: Target, tunable: bool):
        sch, infos = rule_blocks(func, target, "llvm")
        if infos is None:
            return None
        for info in infos:
            loops = sch.get_loops(info.block_rv)
            if loops and info.dom_kind()[:1] == "S":
                sch.parallel(loops[0])
        return sch


class _GPURowReduction(ScheduleRule):
    """A `[batch, vocab] -> [batch]` reduction (producers inlined, injective
    epilogues on `[batch]` allowed): one thread block per row, its threads
    striding over the row and combining across threads at the end."""

    def apply(self, func, target: Target, tunable: bool):
        sch, infos = rule_blocks(func, target, "cuda")
        if infos is None:
            return None
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1 or infos[0] is not reductions[0] or reductions[0].dom_kind() != "SR":
            return None
        main, epilogues = infos[0], infos[1:]
        if any(len(sch.get_loops(e.block_rv)) != 1 for e in epilogues):
            return None
        row, col = sch.get_loops(main.block_rv)
        _, lane = sch.split(col, [None, GPU_THREADS])
        sch.bind(row, "blockIdx.x")
        sch.bind(lane, "threadIdx.x")
        if epilogues:
            # every thread holds the combined value; each finishes the row
            sch.set_scope(main.block_rv, 0, "local")
            for epilogue in epilogues:
                sch.reverse_compute_at(epilogue.block_rv, row)
        return sch


def schedule_rules(target: Target) -> list[ScheduleRule]:
    """The rules the sampler's kernels are scheduled with. There is no
    `dl.gpu.Fallback`: a kernel none of these takes fails the CUDA build."""
    if target.kind.name == "cuda":
        return [_GPURowReduction(), GPUInjective()]
    return [_CPURows()]


def sampler_pipeline(target: Target) -> tvm.transform.Pass:
    """Dispatch sort and scan to the target's kernels, legalize, schedule
    with `schedule_rules`, and lower for the VM."""

    @tvm.transform.module_pass(opt_level=0, name="LockgateSamplerPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        gpu = target.kind.name == "cuda"
        seq = tvm.transform.Sequential(
            [
                relax.backend.DispatchSortScan(),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.DeadCodeElimination(),
                dl.ApplyDefaultSchedule(*schedule_rules(target)),
                *vm_lowering(free_early=[relax.transform.KillAfterLastUse()] if gpu else []),
            ]
        )
        return seq(mod)

    return _pipeline


def build_sampler(vocab: int, target: Target):
    """Compile the sampler for `vocab` tokens: a relax Executable."""
    gpu = target.kind.name == "cuda"
    tvmscript_stack.install()
    mod = sampler_module(vocab, gpu)
    with target:
        return tvm.compile(mod, target=target, relax_pipeline=sampler_pipeline(target))
