"""OpenAI response bodies for chat completions and completions, whole and streamed."""

from __future__ import annotations

import time
from typing import Any

from lockgate.engine import Delta, Usage
from lockgate.engine.sampling import TokenLogprob


class ResponseBuilder:
    """Builds the JSON of one response (or its stream chunks) for an endpoint.

    :param token_bytes: a `lockgate.models.tokenizer.TokenBytes` of the model, to
        spell out tokens in logprobs.
    """

    def __init__(self, *, chat: bool, request_id: str, model: str, token_bytes) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.token_bytes = token_bytes
        #: completions logprobs: characters of text so far per choice (text_offset)
        self._offsets: dict[int, int] = {}

    # ------------------------------------------------------------ logprobs

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (or of a chunk) in the endpoint's shape."""
        if entries is None:
            return None
        text = self.token_bytes.text
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                return {"token": text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

            return {
                "content": [
                    {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(text(e.token_id))
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

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
        self,
        texts: dict[int, str],
        finish_reasons: dict[int, str | None],
        usage: Usage,
        logprobs: dict[int, list[TokenLogprob] | None],
    ) -> dict[str, Any]:
        choices = []
        for index in sorted(texts):
            if self.chat:
                choice = {
                    "index": index,
                    "message": {"role": "assistant", "content": texts[index]},
                    "logprobs": self.logprobs(index, logprobs.get(index)),
                    "finish_reason": finish_reasons.get(index),
                }
            else:
                choice = {
                    "index": index,
                    "text": texts[index],
                    "logprobs": self.logprobs(index, logprobs.get(index)),
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
                "logprobs": self.logprobs(delta.index, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
        else:
            choice = {
                "index": delta.index,
                "text": delta.text,
                "logprobs": self.logprobs(delta.index, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
        return self._chunk([choice], include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        body = self._chunk([], include_usage=False)
        body["usage"] = usage.as_dict()
        return body
