"""What chat completions and completions share: a response of `choices`,
whole or streamed as chunks, with `usage`; the builder base each endpoint's
own builder extends, and the two loops that read the engine's deltas into
them (`collect`, `stream`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from lockgate.engine import Delta, Handle, Usage
from lockgate.engine.sampling import TokenLogprob
from lockgate.errors import ErrorResponse
from lockgate.server.protocol import error_body
from lockgate.server.serving import MergedDeltas, choice_offsets, event_stream, sse_frame, total_usage, write_frames

#: a string as JSON, as json.dumps(..., ensure_ascii=False) writes it
json_string = json.encoder.encode_basestring


def usage_body(usage: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """`usage`; with `reasoning_tokens` (a model that thinks), how many of
    the completion's tokens were thinking; with a predicted output, how many
    of its tokens the output took and did not."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    details = {} if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    if usage.accepted_prediction_tokens is not None:
        details.update(accepted_prediction_tokens=usage.accepted_prediction_tokens,
                       rejected_prediction_tokens=usage.rejected_prediction_tokens)
    if details:
        body["completion_tokens_details"] = details
    return body


class ChoicesBuilder:
    """Builds the JSON of one response of choices (or its stream chunks).

    A subclass names its objects (`OBJECT`, `CHUNK_OBJECT`, the id's
    `ID_PREFIX`) and writes a choice: `choice` (whole), `delta_choice`
    (a chunk's) and `logprobs` (in its endpoint's shape).

    :param token_bytes: a `lockgate.models.tokenizer.TokenBytes` of the model, to
        spell out tokens in logprobs.
    """

    OBJECT: str
    CHUNK_OBJECT: str
    ID_PREFIX: str

    def __init__(self, *, request_id: str, model: str, token_bytes) -> None:
        self.id = self.ID_PREFIX + request_id
        self.model = model
        self.created = int(time.time())
        self.token_bytes = token_bytes
        #: the choices' thinking tokens so far, for a model that thinks (else None)
        self.reasoning_tokens: int | None = None
        #: with `return_token_ids`: each choice's prompt token ids, by index
        #: (else None); a choice's own ids go with its text
        self.prompt_ids: dict[int, list[int]] | None = None
        #: choices whose first chunk has gone out
        self._started: set[int] = set()
        #: per include_usage, the JSON of a stream chunk around its choice
        self._templates: dict[bool, tuple[str, str]] = {}

    def return_token_ids(self, handles: list[Handle]) -> None:
        """Put token ids in the answer (`return_token_ids`): the prompt's and
        each choice's, as vLLM does."""
        self.prompt_ids = {}
        for handle, offset in zip(handles, choice_offsets(handles)):
            for index in range(offset, offset + handle.n):
                self.prompt_ids[index] = list(handle.work.prompt_token_ids)

    def with_token_ids(self, choice: dict[str, Any], index: int, token_ids: list[int]) -> dict[str, Any]:
        """`choice` (a whole one, or a chunk's) with its `token_ids`, when
        the request asked for them; an endpoint whose prompts are per choice
        adds the prompt's (`choice_prompt_ids`)."""
        if self.prompt_ids is not None:
            choice["token_ids"] = list(token_ids)
            if self.PROMPT_IDS_PER_CHOICE and index not in self._started:
                choice["prompt_token_ids"] = self.prompt_ids[index]
            self._started.add(index)
        return choice

    #: whether the prompt's token ids go in each choice (completions: each
    #: prompt its own) rather than once in the response (chat)
    PROMPT_IDS_PER_CHOICE = False

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (or of a chunk)."""
        raise NotImplementedError

    def delta_choice(self, index: int, delta: Delta) -> dict[str, Any]:
        """The one choice of the chunk of an engine delta."""
        raise NotImplementedError

    def delta_choice_json(self, index: int, delta: Delta, reason: str) -> str:
        """`delta_choice` without logprobs as JSON text (`reason` its
        finish_reason as JSON)."""
        raise NotImplementedError

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def whole(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        body = self.envelope(self.OBJECT, choices)
        body["usage"] = usage_body(usage, self.reasoning_tokens)
        if self.prompt_ids is not None and not self.PROMPT_IDS_PER_CHOICE:
            body["prompt_token_ids"] = self.prompt_ids.get(0, [])
        return body

    # ------------------------------------------------------------ streamed

    def chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        body = self.envelope(self.CHUNK_OBJECT, choices)
        if include_usage:
            body["usage"] = None
        return body

    def delta_chunk(self, index: int, delta: Delta, include_usage: bool) -> dict[str, Any]:
        """The chunk of one engine delta, for the response's choice `index`."""
        return self.chunk([self.with_token_ids(self.delta_choice(index, delta), index, delta.token_ids)],
                          include_usage)

    def delta_chunk_json(self, index: int, delta: Delta, include_usage: bool) -> str:
        """`delta_chunk` as JSON text, the same text `json.dumps` writes
        (`ensure_ascii=False`), from a template filled with the text, the
        index and the finish reason: every streamed token is one, and
        building and dumping a dict of dicts each time is most of its cost.
        Chunks with logprobs or token ids are dumped whole."""
        if delta.logprobs is not None or self.prompt_ids is not None:
            return json.dumps(self.delta_chunk(index, delta, include_usage), ensure_ascii=False)
        head, tail = self._chunk_template(include_usage)
        reason = "null" if delta.finish_reason is None else json_string(delta.finish_reason)
        return head + self.delta_choice_json(index, delta, reason) + tail

    def _chunk_template(self, include_usage: bool) -> tuple[str, str]:
        """The JSON of a chunk before and after its one choice."""
        template = self._templates.get(include_usage)
        if template is None:
            empty = json.dumps(self.chunk([], include_usage), ensure_ascii=False)
            cut = empty.index('"choices": []') + len('"choices": [')
            template = self._templates[include_usage] = (empty[:cut], empty[cut:])
        return template

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        body = self.chunk([], include_usage=False)
        body["usage"] = usage_body(usage, self.reasoning_tokens)
        return body


@dataclasses.dataclass
class Collected:
    """Every choice's output, read whole, by choice index."""

    texts: dict[int, str]
    #: every token each choice generated (the one that ended it included)
    token_ids: dict[int, list[int]]
    finish_reasons: dict[int, str | None]
    #: a list per choice when the request asked for logprobs, else None
    logprobs: dict[int, list[TokenLogprob] | None]
    #: the prompt's logprobs, per choice whose first delta carried them
    prompt_logprobs: dict[int, list[TokenLogprob | None]]


async def collect(
    request: web.Request, handles: list[Handle], *, with_logprobs: bool,
    read: Callable[[int, Delta], Delta] | None = None,
) -> Collected:
    """Read every delta of `handles` into whole choices; `read` may change
    each delta first (completions' echo)."""
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    finish_reasons: dict[int, str | None] = {}
    logprobs: dict[int, list | None] = {}
    prompt_logprobs: dict[int, list] = {}
    for index in range(sum(handle.n for handle in handles)):
        texts[index] = []
        token_ids[index] = []
        logprobs[index] = [] if with_logprobs else None
    async for index, delta in MergedDeltas(request, handles):
        if delta.prompt_logprobs is not None:
            prompt_logprobs[index] = delta.prompt_logprobs
        if read is not None:
            delta = read(index, delta)
        texts[index].append(delta.text)
        token_ids[index].extend(delta.token_ids)
        if delta.logprobs:
            logprobs[index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish_reasons[index] = delta.finish_reason
    joined = {index: "".join(parts) for index, parts in texts.items()}
    return Collected(joined, token_ids, finish_reasons, logprobs, prompt_logprobs)


async def stream(
    request: web.Request, handles: list[Handle], builder: ChoicesBuilder, *, include_usage: bool,
    chunks: Callable[[int, Delta], list[bytes]], first: list[dict[str, Any]] = (),
) -> web.StreamResponse:
    """Stream the choices as chunks: `first` (chat's role chunks), then the
    frames `chunks` makes of each delta, what arrived together written in
    one piece; the usage chunk when asked; `[DONE]`, after an error chunk
    too."""

    async def send(response, *payloads: Any) -> None:
        await write_frames(request, response, b"".join(sse_frame(payload) for payload in payloads))

    async def write(response, deltas: MergedDeltas) -> None:
        if first:
            await send(response, *first)
        async for batch in deltas.batches():
            frames = [frame for index, delta in batch for frame in chunks(index, delta)]
            if frames:
                await write_frames(request, response, b"".join(frames))
        if include_usage:
            await send(response, builder.usage_chunk(total_usage(handles)))
        await send(response, "[DONE]")

    async def write_error(response, answer: ErrorResponse) -> None:
        await send(response, error_body(answer), "[DONE]")

    return await event_stream(request, handles, write, write_error)


def plain_chunks(builder: ChoicesBuilder, include_usage: bool) -> Callable[[int, Delta], list[bytes]]:
    """Each delta as its chunk. A token whose text is held back (an
    incomplete UTF-8 sequence, a possible start of a stop string) still has
    its logprobs and token ids: they go out at once, in a chunk with empty
    text."""

    def chunks(index: int, delta: Delta) -> list[bytes]:
        ids = builder.prompt_ids is not None and delta.token_ids
        if delta.text or delta.finish_reason is not None or delta.logprobs or ids:
            return [sse_frame(builder.delta_chunk_json(index, delta, include_usage))]
        return []

    return chunks


def prompt_logprobs_body(builder: ChoicesBuilder, top_n: int, entries: list[TokenLogprob | None] | None):
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or
    `{token id: {"logprob", "rank", "decoded_token"}}` holding the token
    and the `top_n` most likely ones."""
    if entries is None:
        return None
    text = builder.token_bytes.text
    shaped: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            shaped.append(None)
            continue
        position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                          "decoded_token": text(entry.token_id)}}
        for rank, (token_id, logprob) in enumerate(entry.top[:top_n], 1):
            position.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text(token_id)})
        shaped.append(position)
    return shaped
