"""The compile cache: compiled libraries on disk, keyed on what they are
built from, for the model and the sampler alike.

A key hashes the caller's description of the build (config, formats,
target, ...), the sources it is compiled from, and the versions of tvm and
apache-tvm-ffi (the latter decides, for one, whether tensor cores are
used). Files are written to a temporary name and renamed into place, so
concurrent starts never read half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterable

#: the plugin's sources every model library is compiled from (the network's
#: own module is added per network)
MODEL_SOURCES = (
    "layers.py", "formats.py", "decoder.py", "rope.py", "kernels.py", "schedules.py", "pipelines.py", "compile.py",
)
#: the sources the sampler's library is compiled from
SAMPLER_SOURCES = ("sampler_kernels.py", "schedules.py", "pipelines.py")


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
    import tvm
    import tvm_ffi

    h = hashlib.sha256()
    h.update(json.dumps(description, sort_keys=True, default=str).encode())
    h.update(tvm.__version__.encode())
    h.update(str(getattr(tvm_ffi, "__version__", "")).encode())
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
    #: TVM's compiler, `libraries.model_library`)
    target: object
    #: True when the library came from the cache rather than a fresh compile
    cached: bool
    #: storage format of each linear module's weight (`weights.linear_formats`)
    formats: dict[str, str] = dataclasses.field(default_factory=dict)
    #: dtype of each parameter
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: on CUDA, the rule that scheduled each TIR function (`cuda_rules`)
    schedules: dict[str, str] = dataclasses.field(default_factory=dict)
