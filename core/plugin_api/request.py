"""Plain data that flows through the pipeline: requests, work items, error answers."""

from __future__ import annotations

import dataclasses
from typing import Any

from lockgate.engine.params import SamplingParams

CHAT_ENDPOINT = "chat.completions"
COMPLETIONS_ENDPOINT = "completions"


@dataclasses.dataclass
class Request:
    """One request as the pipeline sees it.

    A completions body with a list of prompts becomes one `Request` per
    prompt, sharing the body; `prompt` is that one prompt and `choice_offset`
    the index of its first choice in the response.
    """

    id: str
    endpoint: str
    body: dict[str, Any]
    #: completions only: this request's prompt, text or token ids
    prompt: str | list[int] | None = None
    choice_offset: int = 0
    #: scratch space for plugins, keyed by plugin name
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True
