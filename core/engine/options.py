"""The engine's limits."""

from __future__ import annotations

import dataclasses

from lockgate.settings import setting_default


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Limits of the engine, from the CLI or environment."""

    #: requests waiting for admission before new ones get 429
    max_queue: int = setting_default("max_queue")
    #: most choices (`n`) one request may ask for
    max_n: int = setting_default("max_n")
    #: tokens one step may process (decode tokens plus prefill chunks);
    #: None: the executor's prefill chunk size
    max_num_batched_tokens: int | None = setting_default("max_num_batched_tokens")
    #: keep finished sequences' KV for later requests with the same prefix
    prefix_cache: bool = setting_default("prefix_cache")
    #: draft tokens and verify several a step (`lockgate.engine.speculation`)
    speculation: bool = setting_default("speculation")
    #: drafts verified a step, per choice (0: chosen by measurement)
    speculative_tokens: int = setting_default("speculative_tokens")
    #: speculate only while a step decodes at most this many choices
    speculation_max_batch: int = setting_default("speculation_max_batch")
    #: seconds a client is told to wait on 429 / 503
    retry_after: int = 1
