"""Compile a model family's network (`families/`, built from `decoder.py`
and `layers.py`) for a target, through the pipelines of `pipelines.py`, and
keep the library in the compile cache (`compile_cache.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pathlib
import time
from collections.abc import Callable

import tvm
from tvm.target import Target

from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.compile_cache import cache_key as _library_key
from lockgate.plugins.tvm.compile_cache import (
    LLVM_CPU_VARIABLE,
    MODEL_SOURCES,
    CompiledModel,
    default_cache_dir,
    write_atomically,
)
from lockgate.plugins.tvm.pipelines import cpu_pipeline, cuda_pipeline
from lockgate.plugins.tvm.schedules import tensorize_works
from lockgate.plugins.tvm import tvmscript_stack


def resolve_target(name: str) -> Target:
    """Turn `ExecutorOptions.target` into a TVM target.

    "auto" picks cuda when a CUDA device is present, else the host CPU (or
    the CPU `$LOCKGATE_LLVM_CPU` names).
    """
    if name == "auto":
        name = "cuda" if tvm.cuda().exist else "llvm"
    if name == "llvm":
        cpu = os.environ.get(LLVM_CPU_VARIABLE)
        if cpu:  # a config dict: a target string with -mcpu is rejected by TVM 0.27
            return Target({"kind": "llvm", "mcpu": cpu})
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


def cache_key(
    config: ModelConfig,
    target: Target,
    formats: dict[str, str] | None = None,
    max_batch: int | None = None,
    network: type | None = None,
) -> str:
    """The compile cache's key for a model library.

    Batch, page and chunk sizes are symbolic in the library, so they are not
    part of the key, except on CUDA the decode batch's upper bound
    (`max_batch`), which sizes the CUDA graphs' memory; the weight formats
    are, since each format compiles to its own dequantizing matmul, and so
    are the network and the sources it is built from.
    """
    network = network or default_network()
    here = pathlib.Path(__file__).parent
    description = {
        "config": config.as_dict(),
        "formats": formats or {},
        "target": str(target),
        "network": f"{network.__module__}.{network.__qualname__}",
    }
    if target.kind.name == "cuda":
        description["max_batch"] = max_batch
    sources = [here / name for name in MODEL_SOURCES]
    sources.append(pathlib.Path(inspect.getsourcefile(network)))
    return _library_key(description, sources)


def default_network() -> type:
    """The network of a Llama, for callers that name none."""
    from lockgate.plugins.tvm.families.llama import LlamaForCausalLM

    return LlamaForCausalLM


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
    tvmscript_stack.install()
    model = (network or default_network())(config, target, formats)
    config_: dict = {}
    if target.kind.name == "llvm":
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
    write_atomically(library, lambda tmp: executable.export_library(tmp), ".so")
    body = json.dumps(
        {
            "params": params,
            "dtypes": dtypes,
            "schedules": schedules,
            "target": str(target),
            "tvm": tvm.__version__,
        }
    )
    write_atomically(manifest, lambda tmp: pathlib.Path(tmp).write_text(body), ".json")
    if progress is not None:
        progress(f"compiled for {target.kind.name} in {time.monotonic() - started:.1f} s")
    return CompiledModel(
        library, params, target, cached=False, formats=formats, dtypes=dtypes, schedules=schedules
    )
