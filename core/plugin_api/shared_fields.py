"""What the Responses and Messages bodies share with chat, declared once:
`SharedFields`, the base of `ResponsesRequest` and `MessagesRequest`, holds
the request id, the body and the fields read as chat reads them (the same
readers and defaults, `body.same_as`); `shared_values` hands them to the
chat request each becomes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lockgate.plugin_api.body import same_as
from lockgate.plugin_api.request import ChatRequest


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedFields:
    """The fields of another API's body that are chat's own."""

    id: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    model: str = same_as(ChatRequest, "model")
    stream: bool = same_as(ChatRequest, "stream")
    top_p: float = same_as(ChatRequest, "top_p")
    top_k: int = same_as(ChatRequest, "top_k")
    seed: int | None = same_as(ChatRequest, "seed")
    logit_bias: Mapping[int, float] = same_as(ChatRequest, "logit_bias")
    min_p: float = same_as(ChatRequest, "min_p")
    repetition_penalty: float = same_as(ChatRequest, "repetition_penalty")
    ignore_eos: bool = same_as(ChatRequest, "ignore_eos")
    min_tokens: int = same_as(ChatRequest, "min_tokens")
    parallel_tool_calls: bool = same_as(ChatRequest, "parallel_tool_calls")

    def shared_values(self) -> dict[str, Any]:
        """Every field declared `same_as` chat's (this class's and a
        subclass's own), by name, for the chat request."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.metadata.get("shared")}
