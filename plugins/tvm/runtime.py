"""TVM's runtime as the executor uses it, through tvm-ffi alone.

`import tvm` runs TVM's whole Python package (its IR, TIR script, target,
driver and support modules), even where only the runtime library is loaded:
35 MiB resident and most of a second in a serving process that compiles
nothing. The executor needs only functions the runtime library registers by
name: load a compiled library and run its VM, allocate tensors and copy
them to and from numpy, call the KV cache's builtins. This module loads
`libtvm_runtime` as `tvm.base` does (the same file, so a later `import tvm`
finds it loaded) and reaches those functions through tvm-ffi. CUDA's
device runtime is loaded by `load_cuda`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import pathlib
import sys

import numpy as np

#: packages tvm-ffi imports if they are installed, for dtypes (bfloat16,
#: float8) and tensors the executor never hands it: ml_dtypes costs a
#: runtime-only process 8 MiB resident and 0.6 s, torch hundreds of MiB
_OPTIONAL_FOR_FFI = ("ml_dtypes", "torch")


def _import_tvm_ffi():
    """`import tvm_ffi`; in a runtime-only process, without the packages of
    `_OPTIONAL_FOR_FFI` (it looks for them once, at import). Only the import
    is kept from them: they stay importable for anything else afterwards."""
    if not runtime_only() or "tvm_ffi" in sys.modules:
        import tvm_ffi

        return tvm_ffi
    blocked = [name for name in _OPTIONAL_FOR_FFI if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # an import of it raises ImportError
    try:
        import tvm_ffi
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return tvm_ffi

#: the VM's allocators (`tvm.runtime.vm.VirtualMachine`)
_ALLOCATORS = {"naive": 1, "pooled": 2}

#: device attributes of `runtime.GetDeviceAttr`
_EXISTS, _COMPUTE_VERSION = 0, 4

_loaded = False
_cuda_tried = False


def _lib_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the apache-tvm package is not installed")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "lib"


def runtime_only() -> bool:
    """Whether this process runs TVM's runtime library without the compiler
    (`TVM_USE_RUNTIME_LIB=1`, which `lockgate serve` sets)."""
    if "tvm" in sys.modules:
        return bool(sys.modules["tvm"].base._RUNTIME_ONLY)
    return os.environ.get("TVM_USE_RUNTIME_LIB") == "1"


tvm_ffi = _import_tvm_ffi()
Shape = tvm_ffi.Shape


def load() -> None:
    """Load TVM's runtime library once: alone in a runtime-only process,
    else by importing `tvm` with its compiler."""
    global _loaded
    if _loaded or "tvm" in sys.modules:
        _loaded = True
        return
    if not runtime_only():
        import tvm  # noqa: F401  (the compiler registers its functions too)

        _loaded = True
        return
    from tvm_ffi.libinfo import load_lib_ctypes

    load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=[_lib_dir()])
    # as `tvm.base` does without the compiler: objects of types only the
    # compiler registers are skipped, not refused
    from tvm_ffi import registry

    registry._SKIP_UNKNOWN_OBJECTS = True
    _loaded = True


def load_cuda() -> None:
    """TVM's CUDA runtime, in a runtime-only process: `import tvm` loads its
    device backends only with the compiler, and without this such a process
    sees no CUDA device at all. Where CUDA is missing nothing changes."""
    global _cuda_tried
    load()
    if _cuda_tried or not runtime_only():
        return
    _cuda_tried = True
    from tvm_ffi.libinfo import load_lib_ctypes

    try:
        load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=[_lib_dir()])
    except (OSError, RuntimeError):
        pass


def _cuda_attr(attr: int):
    load_cuda()
    try:
        return tvm_ffi.get_global_func("runtime.GetDeviceAttr")(int(tvm_ffi.DLDeviceType.kDLCUDA), 0, attr)
    except Exception:  # noqa: BLE001 - no CUDA device API in this build or machine
        return None


def cuda_exists() -> bool:
    """Whether a CUDA device is present (and TVM's CUDA runtime loads)."""
    return bool(_cuda_attr(_EXISTS))


def cuda_compute_version() -> str:
    """The first CUDA device's compute capability, "9.0"."""
    return str(_cuda_attr(_COMPUTE_VERSION))


def tvm_versions() -> tuple[str, str]:
    """apache-tvm's and apache-tvm-ffi's versions, read without `import tvm`."""
    from importlib.metadata import version

    return version("apache-tvm"), version("apache-tvm-ffi")


@functools.cache
def get_global_func(name: str):
    """A function the runtime registers, looked up once (the executor calls
    the tensor functions below every step)."""
    load()
    return tvm_ffi.get_global_func(name)


def device(kind: str, index: int = 0):
    return tvm_ffi.device(kind, index)


def empty(shape, dtype: str, dev):
    """An uninitialized tensor on `dev`."""
    return get_global_func("runtime.TVMTensorAllocWithScope")(Shape(list(shape)), dtype, dev, None)


def from_numpy(array: np.ndarray, dev):
    """A copy of `array` (possibly a strided view) in a new tensor on `dev`."""
    tensor = empty(array.shape, str(array.dtype), dev)
    if dev.dlpack_device_type() == tvm_ffi.DLDeviceType.kDLCPU:
        # straight into the tensor's memory: one pass, no contiguous copy first
        np.copyto(np.from_dlpack(tensor), array, casting="no")
    else:
        host = np.ascontiguousarray(array)
        get_global_func("runtime.TVMTensorCopyFromBytes")(tensor, host.ctypes.data_as(ctypes.c_void_p), host.nbytes)
    return tensor


def to_numpy(tensor) -> np.ndarray:
    """A host copy of `tensor`."""
    out = np.empty(tuple(int(d) for d in tensor.shape), dtype=str(tensor.dtype))
    get_global_func("runtime.TVMTensorCopyToBytes")(tensor, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
    return out


def create_view(tensor, shape):
    """`tensor`'s memory seen with another shape (the caller keeps `tensor`)."""
    return get_global_func("runtime.TVMTensorCreateView")(tensor, Shape(list(shape)), tensor.dtype, 0)


def load_vm(path: str, dev, allocator: str = "pooled"):
    """The relax VM of a compiled library, on `dev` (and the CPU for host
    work); `vm[name]` is a function of the library."""
    load()
    executable = tvm_ffi.load_module(path)["vm_load_executable"]()
    args = [int(dev.dlpack_device_type()), dev.index, _ALLOCATORS[allocator]]
    if dev.dlpack_device_type() != tvm_ffi.DLDeviceType.kDLCPU:
        args += [int(tvm_ffi.DLDeviceType.kDLCPU), 0, _ALLOCATORS[allocator]]
    executable["vm_initialization"](*args)
    return executable


def set_num_threads(num_threads: int | None) -> None:
    """Size TVM's CPU thread pool.

    None keeps an explicit `TVM_NUM_THREADS` and otherwise uses every CPU
    this process may run on: left alone, TVM counts physical cores by its
    own heuristics and picked one thread on two-vCPU machines.
    """
    if num_threads is None:
        if os.environ.get("TVM_NUM_THREADS"):
            return
        num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    # The pool reads the variable when it first starts; the explicit call
    # resizes a pool that another executor in this process already started.
    os.environ["TVM_NUM_THREADS"] = str(num_threads)
    get_global_func("runtime.config_threadpool")(1, num_threads)
