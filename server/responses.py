"""OpenAI response bodies for chat completions and completions, whole and streamed."""

from __future__ import annotations

import time
from typing import Any

from lockgate.engine import Delta, Usage


class ResponseBuilder:
    """Builds the JSON of one response (or its stream chunks) for an endpoint."""

    def __init__(self, *, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    # ------------------------------------------------------------ whole

    def completion(
        self, texts: dict[int, str], finish_reasons: dict[int, str | None], usage: Usage
    ) -> dict[str, Any]:
        choices = []
        for index in sorted(texts):
            if self.chat:
                choice = {
                    "index": index,
                    "message": {"role": "assistant", "content": texts[index]},
                    "logprobs": None,
                    "finish_reason": finish_reasons.get(index),
                }
            else:
                choice = {
                    "index": index,
                    "text": texts[index],
                    "logprobs": None,
                    "finish_reason": finish_reasons.get(index),
                }
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage.as_dict()
        return body

    # ------------------------------------------------------------ streamed

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        """The first chunk of a chat choice: the assistant role, no text yet."""
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            include_usage,
        )

    def delta_chunk(self, delta: Delta, include_usage: bool) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": delta.index,
                "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
                "logprobs": None,
                "finish_reason": delta.finish_reason,
            }
        else:
            choice = {
                "index": delta.index,
                "text": delta.text,
                "logprobs": None,
                "finish_reason": delta.finish_reason,
            }
        return self._chunk([choice], include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        body = self._chunk([], include_usage=False)
        body["usage"] = usage.as_dict()
        return body
