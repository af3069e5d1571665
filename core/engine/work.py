"""What the engine is asked to run for one request."""

from __future__ import annotations

import dataclasses

from lockgate.engine.params import SamplingParams


@dataclasses.dataclass
class Work:
    """What the engine runs for one request: prompt tokens and how to
    sample, or how to pool the prompt's hidden states instead."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: None: generate; else read the prompt's final hidden states pooled
    #: this way (`lockgate.engine.pooling.POOLINGS`), generating nothing:
    #: the one delta carries them as `Delta.embedding`
    pooling: str | None = None
