"""Test plugin (loaded by name through `LOCKGATE_PLUGINS`, so Ray replicas
load it too): the `poisoned` executor, the real TVM executor except that a
sequence whose prompt holds token `POISON` fails its third decode step —
a fault after the response started."""

from __future__ import annotations

from lockgate import hookimpl

POISON = 77
FAIL_AT_DECODE = 3


class PoisonedExecutor:
    #: no speculation: a verification runs through `prefill`, which would
    #: leave the decode steps to count (and the chunks before the fault) to
    #: the policy's timing
    can_truncate = False

    def __init__(self, real) -> None:
        self.real = real
        self.decodes: dict[int, int] = {}  # poisoned sequence -> decode steps so far

    def __getattr__(self, name):
        return getattr(self.real, name)

    def prefill(self, seq_ids, token_ids, all_positions=None):
        for seq_id, tokens in zip(seq_ids, token_ids):
            if POISON in tokens:
                self.decodes.setdefault(seq_id, 0)
        return self.real.prefill(seq_ids, token_ids, all_positions)

    def decode(self, seq_ids, token_ids):
        for seq_id in seq_ids:
            if seq_id in self.decodes:
                self.decodes[seq_id] += 1
                if self.decodes[seq_id] >= FAIL_AT_DECODE:
                    raise RuntimeError("injected decode failure")
        return self.real.decode(seq_ids, token_ids)

    def remove_sequence(self, seq_id):
        self.decodes.pop(seq_id, None)
        return self.real.remove_sequence(seq_id)


@hookimpl
def lockgate_register_executors(register):
    from lockgate.plugins.tvm import create_executor

    register("poisoned", lambda model_file, options: PoisonedExecutor(create_executor(model_file, options)))
