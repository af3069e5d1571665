"""The compile cache: compiled libraries on disk, keyed on what they are
built from, for the model and the sampler alike.

A key hashes the caller's description of the build (config, formats,
target, ...), the sources it is compiled from, and the versions of tvm and
apache-tvm-ffi (the latter decides, for one, whether tensor cores are
used). Files are written to a temporary name and renamed into place, so
concurrent starts never read half a file.

Without TVM's compiler: its library costs a process about 107 MiB of
resident memory (its pages and what importing it allocates) that running a
compiled library never uses. A process that imports TVM with `TVM_USE_RUNTIME_LIB=1` (as
`lockgate serve` does) gets the runtime library alone; it can load and run
a library from the compile cache, but neither build one nor describe its
target (`Target.from_device` asks the compiler's LLVM).

So each library the executor loads is also recorded under a *request key*:
a hash of what the caller asked for in plain strings (the config, the
weight formats, the target's kind with the host CPU or the CUDA
architecture, the network's name and the sources it is built from, the
TVM versions). The record names the library and carries what the executor
would otherwise ask the compiler-side objects (the parameters, their
dtypes, the KV page size, the network's prefill chunk limit and whether
it shares prefixes).
On a miss the library is built by `compile.compile_model` (its own cache,
keyed on the full TVM target, may already hold it), in this process when
the compiler is loaded, else in a child process that loads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig

#: the plugin's sources every model library is compiled from (the network's
#: own module is added per network)
MODEL_SOURCES = (
    "layers.py", "formats.py", "int8_matmul.py", "int8_activations.py", "tir_vectors.py", "decoder.py", "rope.py",
    "paged_attention.py", "schedules.py", "pipelines.py", "compile.py",
)
#: the sources the sampler's library is compiled from
SAMPLER_SOURCES = ("sampler_kernels.py", "sampler_build.py", "schedules.py", "pipelines.py")


def default_cache_dir() -> pathlib.Path:
    """`$LOCKGATE_CACHE_DIR`, else `~/.cache/lockgate`."""
    env = os.environ.get("LOCKGATE_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "lockgate"


def cache_key(description: dict, sources: Iterable[pathlib.Path]) -> str:
    """Hash of everything a compiled library depends on: `description`
    (JSON-able), the bytes of each source file, and the tvm and
    apache-tvm-ffi versions."""
    from lockgate.plugins.tvm.runtime import tvm_versions

    tvm_version, ffi_version = tvm_versions()
    h = hashlib.sha256()
    h.update(json.dumps(description, sort_keys=True, default=str).encode())
    h.update(tvm_version.encode())
    h.update(ffi_version.encode())
    for path in sources:
        path = pathlib.Path(path)
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


def write_atomically(path: pathlib.Path, write: Callable[[str], None], suffix: str) -> None:
    """Write `path` through `write(temporary_path)` and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclasses.dataclass(frozen=True)
class CompiledModel:
    """A compiled library on disk and the parameters it expects."""

    library: pathlib.Path
    #: (name, shape) of each parameter, in the order the functions take them
    params: list[tuple[str, tuple[int, ...]]]
    #: the TVM target it was compiled for (its text when found without
    #: TVM's compiler, `model_library`)
    target: object
    #: True when the library came from the cache rather than a fresh compile
    cached: bool
    #: storage format of each linear module's weight (`weights.linear_formats`)
    formats: dict[str, str] = dataclasses.field(default_factory=dict)
    #: dtype of each parameter
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: on CUDA, the rule that scheduled each TIR function (`cuda_rules`)
    schedules: dict[str, str] = dataclasses.field(default_factory=dict)


def compiler_loaded() -> bool:
    """Whether this process's TVM can compile (it was not imported with
    `TVM_USE_RUNTIME_LIB=1`)."""
    from lockgate.plugins.tvm.runtime import runtime_only

    return not runtime_only()


def target_kind(name: str) -> str:
    """`ExecutorOptions.target` as "llvm" or "cuda", asking the runtime
    only: "auto" is cuda when a CUDA device is present."""
    from lockgate.plugins.tvm.runtime import cuda_exists

    if name == "auto":
        return "cuda" if cuda_exists() else "llvm"
    if name == "cuda" and not cuda_exists():
        raise ValueError("target 'cuda' asked for, but no CUDA device is present")
    if name not in ("llvm", "cuda"):
        raise ValueError(f"unknown target {name!r}: expected 'auto', 'llvm' or 'cuda'")
    return name


#: an LLVM CPU name (`haswell`, `znver4`, …) to compile the llvm target for
#: instead of the host's CPU (`compile.resolve_target`): code for an older
#: instruction set (AVX2 on an AVX-512 host, as `benchmarks/executor.py
#: --cpu` measures it), or for a fleet's lowest common CPU
LLVM_CPU_VARIABLE = "LOCKGATE_LLVM_CPU"


def _target_description(kind: str) -> dict:
    """What decides the code TVM generates for `kind` on this machine: the
    CUDA architecture, or the host CPU (LLVM targets its model and
    features), read without the compiler."""
    from lockgate.plugins.tvm.runtime import cuda_compute_version

    if kind == "cuda":
        return {"kind": "cuda", "arch": cuda_compute_version(), "machine": platform.machine()}
    cpu = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("vendor_id", "cpu family", "model", "model name", "flags") and name not in cpu:
                    cpu[name] = value.strip()
                if not line.strip() and cpu:
                    break
    except OSError:
        cpu["processor"] = platform.processor()
    description = {"kind": "llvm", "machine": platform.machine(), "cpu": cpu}
    if os.environ.get(LLVM_CPU_VARIABLE):
        description["llvm_cpu"] = os.environ[LLVM_CPU_VARIABLE]
    return description


def network_name(network) -> str:
    """A family's network as "module:attribute" text."""
    if isinstance(network, str):
        return network
    return f"{network.__module__}:{network.__qualname__}"


def _network_source(network) -> pathlib.Path:
    if not isinstance(network, str):
        return pathlib.Path(inspect.getsourcefile(network))
    module = network.partition(":")[0]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"cannot find the network module {module!r}")
    return pathlib.Path(spec.origin)


def _request_key(description: dict, sources: list[pathlib.Path]) -> str:
    return cache_key({"request": description}, sources)


def model_request_key(config: ModelConfig, kind: str, formats: dict[str, str], max_batch: int | None, network) -> str:
    here = pathlib.Path(__file__).parent
    description = {
        "config": config.as_dict(),
        "formats": formats,
        "target": _target_description(kind),
        "network": network_name(network),
        "max_batch": max_batch if kind == "cuda" else None,
    }
    return _request_key(description, [here / n for n in MODEL_SOURCES] + [_network_source(network)])


def sampler_request_key(vocab: int, kind: str) -> str:
    here = pathlib.Path(__file__).parent
    return _request_key({"vocab": int(vocab), "target": _target_description(kind)}, [here / n for n in SAMPLER_SOURCES])


def _record_path(cache_dir: pathlib.Path, key: str) -> pathlib.Path:
    return cache_dir / f"lockgate-request-{key}.json"


def _read_record(cache_dir: pathlib.Path, key: str) -> dict | None:
    try:
        record = json.loads(_record_path(cache_dir, key).read_text())
        if (cache_dir / record["library"]).exists():
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_record(cache_dir: pathlib.Path, key: str, record: dict) -> None:
    body = json.dumps(record)
    write_atomically(_record_path(cache_dir, key), lambda tmp: pathlib.Path(tmp).write_text(body), ".json")


def _compiled_from(cache_dir: pathlib.Path, record: dict, cached: bool) -> tuple[CompiledModel, dict]:
    compiled = CompiledModel(
        cache_dir / record["library"],
        [(n, tuple(s)) for n, s in record["params"]],
        record["target"],
        cached=cached,
        formats=dict(record["formats"]),
        dtypes=dict(record["dtypes"]),
        schedules=dict(record.get("schedules", {})),
    )
    return compiled, dict(record["network"])


def model_library(
    config: ModelConfig,
    kind: str,
    cache_dir: pathlib.Path | None,
    progress: Callable[[str], None] | None,
    formats: dict[str, str],
    max_batch: int | None,
    network,
) -> tuple[CompiledModel, dict]:
    """The model's library: (`CompiledModel`, the network's answers
    `{"page_size": ..., "max_prefill_chunk": ...,
    "shares_prefixes": ...}`), recorded under
    its request key, built on a miss. `network` is the family's network (a
    class or "module:attribute" text); it is imported only to build."""
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = network_name(network)
    key = model_request_key(config, kind, dict(formats), max_batch, network)
    record = _read_record(cache_dir, key)
    if record is not None:
        return _compiled_from(cache_dir, record, cached=True)
    request = {
        "what": "model",
        "config": config.as_dict(),
        "kind": kind,
        "formats": dict(formats),
        "max_batch": max_batch,
        "network": name,
        "cache_dir": str(cache_dir),
        "key": key,
    }
    cached = _build(request, progress, network if not isinstance(network, str) else None)
    record = _read_record(cache_dir, key)
    if record is None:
        raise ModelLoadError(f"the model's library was built but {_record_path(cache_dir, key)} is unreadable")
    return _compiled_from(cache_dir, record, cached=cached)


def sampler_library(vocab: int, kind: str, cache_dir: pathlib.Path, progress=None) -> pathlib.Path:
    """The device sampler's library for (vocab, kind), recorded under its
    request key, built on a miss."""
    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = sampler_request_key(vocab, kind)
    record = _read_record(cache_dir, key)
    if record is None:
        request = {"what": "sampler", "vocab": int(vocab), "kind": kind, "cache_dir": str(cache_dir), "key": key}
        _build(request, progress, None)
        record = _read_record(cache_dir, key)
        if record is None:
            raise ModelLoadError(f"the sampler's library was built but {_record_path(cache_dir, key)} is unreadable")
    return cache_dir / record["library"]


def _build(request: dict, progress, network) -> bool:
    """Build what `request` asks for and record it: in this process when
    TVM's compiler is loaded, else in a child that loads it. True when the
    library was in the full-target compile cache already."""
    if compiler_loaded():
        return build(request, progress, network)
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    child = subprocess.Popen(
        [sys.executable, "-m", "lockgate.plugins.tvm.compile_cache"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    child.stdin.write(json.dumps(request))
    child.stdin.close()
    cached = False
    for line in child.stdout:
        kind, _, text = line.rstrip("\n").partition(" ")
        if kind == "progress" and progress is not None:
            progress(text)
        elif kind == "cached":
            cached = text == "true"
    error = child.stderr.read()
    if child.wait() != 0:
        raise ModelLoadError(f"compiling the {request['what']}'s library failed:\n{error[-4000:]}")
    return cached


def build(request: dict, progress=None, network=None) -> bool:
    """Build (or find in the full-target compile cache) the library
    `request` describes and write its request record. Needs the compiler."""
    from lockgate.plugins.tvm.compile import compile_model, resolve_target

    cache_dir = pathlib.Path(request["cache_dir"])
    target = resolve_target(request["kind"])
    if request["what"] == "sampler":
        from lockgate.plugins.tvm.sampler import compiled_sampler

        library = compiled_sampler(request["vocab"], target, cache_dir)
        _write_record(cache_dir, request["key"], {"library": library.name})
        return False
    if network is None:
        module, _, attribute = request["network"].partition(":")
        network = importlib.import_module(module)
        for part in attribute.split("."):
            network = getattr(network, part)
    config = _config_from_dict(request["config"])
    compiled = compile_model(
        config, target, cache_dir, progress, request["formats"], max_batch=request["max_batch"], network=network
    )
    from lockgate.plugins.tvm.page_pool import PAGE_SIZE

    kind = target.kind.name
    limit = getattr(network, "max_prefill_chunk", lambda _config, _kind: None)(config, kind)
    record = {
        "library": compiled.library.name,
        "params": compiled.params,
        "dtypes": compiled.dtypes,
        "formats": compiled.formats,
        "schedules": compiled.schedules,
        "target": str(target),
        "network": {
            "page_size": PAGE_SIZE,
            "max_prefill_chunk": None if limit is None else int(limit),
            "shares_prefixes": bool(getattr(network, "shares_prefixes", lambda _config, _kind: True)(config, kind)),
        },
    }
    _write_record(cache_dir, request["key"], record)
    return compiled.cached


def _config_from_dict(values: dict) -> ModelConfig:
    # JSON turned the config's tuples into lists
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _child_main() -> None:
    request = json.loads(sys.stdin.read())
    cached = build(request, lambda message: print("progress", message, flush=True))
    print("cached", "true" if cached else "false", flush=True)


if __name__ == "__main__":
    _child_main()
