"""Test plugin (a module, so a model's child process loads it too): the
`slow` executor, the real TVM executor taking `DECODE_SECONDS` more for
each decode step, so a request is still generating when a test acts on it
(kills its process, say)."""

from __future__ import annotations

import time

from lockgate import hookimpl

DECODE_SECONDS = 0.01


class SlowExecutor:
    #: no speculation: a verification would decode several tokens a step
    can_truncate = False

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode(self, seq_ids, token_ids):
        time.sleep(DECODE_SECONDS)
        return self.real.decode(seq_ids, token_ids)


@hookimpl
def lockgate_register_executors(register):
    from lockgate.plugins.tvm import create_executor

    register("slow", lambda model_file, options: SlowExecutor(create_executor(model_file, options)))
