"""The engine's limits."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Limits of the engine, from the CLI or environment."""

    #: requests waiting for admission before new ones get 429
    max_queue: int = 256
    #: most choices (`n`) one request may ask for
    max_n: int = 8
    #: tokens one step may process (decode tokens plus prefill chunks);
    #: None: the executor's prefill chunk size
    max_num_batched_tokens: int | None = None
    #: seconds a client is told to wait on 429 / 503
    retry_after: int = 1
