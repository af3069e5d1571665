"""`tvmscript_stack.quick_stack`: what TVMScript's parsers read of
`inspect.stack()`, without its cost."""

from __future__ import annotations

import inspect

from lockgate.plugins.tvm import tvmscript_stack


def _nested(depth: int, probe):
    return probe() if depth == 0 else _nested(depth - 1, probe)


def test_the_quick_stack_has_every_frame_and_the_first_three_in_full():
    both = _nested(5, lambda: (tvmscript_stack.quick_stack(), inspect.stack()))
    quick, full = both
    # the same frames (the probe's own line differs by the second call only)
    assert [f.frame for f in quick] == [f.frame for f in full]
    assert [(f.function, f.filename) for f in quick] == [(f.function, f.filename) for f in full]
    for mine, theirs in zip(quick[:tvmscript_stack.FULL_FRAMES], full):
        assert mine.code_context == theirs.code_context and mine.index == theirs.index
    assert all(f.code_context is None for f in quick[tvmscript_stack.FULL_FRAMES:])


def test_installed_the_parsers_still_parse_and_see_closures():
    tvmscript_stack.install()
    tvmscript_stack.install()  # idempotent
    from tvm.script import tirx as T
    from tvm.tirx.script.parser import entry

    assert entry.inspect.stack is tvmscript_stack.quick_stack
    assert entry.inspect.isfunction is inspect.isfunction
    width = 8

    @T.prim_func
    def fill(a: T.Buffer((width,), "float32")):
        for i in range(width):
            a[i] = T.float32(1)

    assert len(fill.params) == 1 and "(8,)" in fill.script()  # the closure's width, resolved
