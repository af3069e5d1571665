"""A cheaper `inspect.stack()` for TVMScript's parser entries.

`T.prim_func`, `I.ir_module` and `R.function` call `inspect.stack()` each
time they parse a function (a model's compile parses hundreds: the KV
cache's kernels, the legalized operators). That reads the source lines of
every frame on the stack, and a frame whose file is not on disk makes
`inspect.getmodule` scan all of `sys.modules`: in a process that has
imported much (a test session with Ray loaded), a 1B-shaped CUDA compile
spent 115 of its 132 seconds there. The parsers only read the frames
themselves (their locals, for closure variables) and the source line of
the third (whether the function is defined in a class), so `quick_stack`
gives exactly that: the first three frames as `inspect.stack()` has them,
the rest without source lines. `install()` points the parser entries'
`inspect` at it; nothing else in the process sees a change.
"""

from __future__ import annotations

import inspect
import sys
import types

#: frames given with their source lines, as `inspect.stack()` gives every frame
FULL_FRAMES = 3


def quick_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.stack(context)` of the caller, source lines only for the
    first `FULL_FRAMES` frames."""
    frame = sys._getframe(1)
    frames: list[inspect.FrameInfo] = []
    while frame is not None:
        if len(frames) < FULL_FRAMES:
            info = inspect.getframeinfo(frame, context)
            frames.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        else:
            code = frame.f_code
            frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None))
        frame = frame.f_back
    return frames


class _Inspect(types.ModuleType):
    """`inspect` with `stack` replaced."""

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    stack = staticmethod(quick_stack)


def install() -> None:
    """Have TVMScript's parser entries call `quick_stack` (idempotent)."""
    from tvm.relax.script.parser import entry as relax_entry
    from tvm.script.parser.ir import entry as ir_entry
    from tvm.tirx.script.parser import entry as tir_entry

    for module in (tir_entry, ir_entry, relax_entry):
        if not isinstance(module.inspect, _Inspect):
            module.inspect = _Inspect("inspect")
