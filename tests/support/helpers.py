"""Helpers the tests share (imported as `from helpers import ...`; the
fixtures are in tests/conftest.py): executor sizes for the tiny model,
waiting for an engine to go idle or a condition to hold, one sampled token,
and the instrumented executor that records every forward pass by step."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

from lockgate import hookimpl

#: executor options every tiny model is loaded with
TINY_EXECUTOR = dict(max_num_seqs=8, max_total_tokens=4096, prefill_chunk_size=256)

# Raises on any conversation that does not alternate user/assistant starting
# with user, as many real templates do (Mistral, Llama 2).
ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


async def wait_idle(engine, timeout: float = 60.0) -> dict:
    """Wait until the engine holds no request and no KV page; return its stats
    (as they are at `timeout` if it never gets there: callers assert on them)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats.requests_running == 0 and stats.requests_waiting == 0
        if idle and stats.kv_pages_used == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def wait_for(condition, timeout: float = 60.0, what: str | None = None):
    """Poll `condition()` (a function or a coroutine function) until it returns
    something true and return that; fail after `timeout` seconds. The deadline
    is generous: it only bounds how long a failing test takes."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what or getattr(condition, '__name__', condition)} after {timeout} s")
        await asyncio.sleep(0.02)


def sample_one(logits, params, rng, prompt_ids=(), output_ids=()) -> int:
    """One token from one row of logits, through the engine's batch sampler."""
    from lockgate.engine.sampling import SamplingRow, sample_batch

    tokens, _ = sample_batch(logits[None, :], [SamplingRow(params, rng, prompt_ids, output_ids)])
    return int(tokens[0])


class InstrumentedExecutor:
    """Test double: the real executor, recording how many tokens of which
    sequence every forward pass carries, by engine step; decodes can be held
    or slowed down. It does not offer `truncate`, so the engine decodes
    through `decode` (no speculative step goes through `prefill` instead)."""

    can_truncate = False

    def __init__(self, real):
        self.real = real
        #: per engine step, its forward passes: ("decode" | "prefill", {seq_id: tokens})
        self.steps: list[list[tuple[str, dict[int, int]]]] = []
        #: forward passes made outside an engine step (there should be none)
        self.outside_steps: list[tuple[str, dict[int, int]]] = []
        self.in_step = False
        #: decodes wait while this is clear
        self.decodes_allowed = threading.Event()
        self.decodes_allowed.set()
        #: every decode takes at least this long
        self.decode_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _record(self, kind, rows):
        (self.steps[-1] if self.in_step else self.outside_steps).append((kind, rows))

    def prefill(self, seq_ids, token_ids, all_positions=None):
        self._record("prefill", {s: len(t) for s, t in zip(seq_ids, token_ids)})
        return self.real.prefill(seq_ids, token_ids, all_positions)

    def decode(self, seq_ids, token_ids):
        self._record("decode", {s: 1 for s in seq_ids})
        if not self.decodes_allowed.wait(120):
            raise RuntimeError("decodes were held for 120 s")
        time.sleep(self.decode_seconds)
        return self.real.decode(seq_ids, token_ids)


class InstrumentedExecutors:
    """Plugin: the `tvm` executor wrapped in an `InstrumentedExecutor`."""

    @hookimpl
    def lockgate_register_executors(self, register):
        from lockgate.plugins.tvm import create_executor

        register("instrumented", lambda model_file, options: InstrumentedExecutor(create_executor(model_file, options)))
