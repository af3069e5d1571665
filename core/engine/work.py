"""What the engine is asked to run for one request."""

from __future__ import annotations

import dataclasses

from lockgate.engine.params import SamplingParams


@dataclasses.dataclass
class Work:
    """What the engine runs for one request: prompt tokens and how to sample."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
