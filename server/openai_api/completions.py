"""`POST /v1/completions`: a `text_completion` whole or streamed; several
prompts in one body answer as one response, prompt `i`'s choices after
those of the prompts before it; `echo` puts each prompt in front of its
choices' text (and its tokens' logprobs in front of theirs)."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from lockgate.engine import Delta, Handle
from lockgate.engine.sampling import TokenLogprob
from lockgate.models import Model
from lockgate.plugin_api.request import COMPLETIONS_ENDPOINT, CompletionRequest, parse_request
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.openai_api.choices import (
    ChoicesBuilder, collect, json_string, plain_chunks, prompt_logprobs_body, stream,
)
from lockgate.server.serving import choice_offsets, generate, total_usage

routes = web.RouteTableDef()


class CompletionBuilder(ChoicesBuilder):
    """A `text_completion` and its chunks."""

    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    ID_PREFIX = "cmpl-"
    PROMPT_IDS_PER_CHOICE = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        #: characters of text so far per choice (text_offset)
        self._offsets: dict[int, int] = {}

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        text = self.token_bytes.text

        def top(e: TokenLogprob) -> dict[str, float] | None:
            # keyed by text, as OpenAI has it: of tokens spelled alike (byte
            # tokens that are not whole characters), the likeliest stands
            if e.top is None:
                return None
            spelled: dict[str, float] = {}
            for t, lp in e.top:
                spelled.setdefault(text(t), lp)
            return spelled

        offsets = []
        for e in entries:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(text(e.token_id))
        return {
            "tokens": [text(e.token_id) for e in entries],
            # an echoed prompt's first token has no logprob (nothing before it)
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets,
        }

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason}

    def delta_choice(self, index: int, delta: Delta) -> dict[str, Any]:
        return self.choice(index, delta.text, delta.finish_reason, delta.logprobs)

    def delta_choice_json(self, index: int, delta: Delta, reason: str) -> str:
        return f'{{"index": {index}, "text": {json_string(delta.text)}, "logprobs": null, "finish_reason": {reason}}}'


class Echo:
    """`echo`: each choice's answer starts with its prompt.

    `apply` puts the prompt's text in front of a choice's first delta and,
    when the request asked for logprobs, the prompt tokens' logprobs (which
    the engine hands over on that delta) in front of its logprobs: the
    first prompt token with a null logprob and null alternatives, as
    OpenAI reports it.

    :param prompts: per choice index, the prompt's text and token ids.
    :param top_n: alternatives per token the request's `logprobs` asks for
        (the engine may have found more, for `prompt_logprobs`).
    """

    def __init__(self, prompts: dict[int, tuple[str, list[int]]], top_n: int | None = None) -> None:
        self._waiting = dict(prompts)
        self._top_n = top_n

    @classmethod
    def of(cls, typed: CompletionRequest, handles: list[Handle], model: Model) -> "Echo":
        """Each choice's prompt, as sent (a token-id prompt decoded)."""
        prompts = {}
        for one, handle, offset in zip(typed.split(), handles, choice_offsets(handles)):
            token_ids = handle.work.prompt_token_ids
            text = one.prompt if isinstance(one.prompt, str) else model.tokenizer.decode(
                token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for index in range(offset, offset + handle.n):
                prompts[index] = (text, token_ids)
        return cls(prompts, typed.logprobs)

    def apply(self, index: int, delta: Delta) -> Delta:
        prompt = self._waiting.pop(index, None)
        if prompt is None:
            return delta
        text, token_ids = prompt
        logprobs = delta.logprobs
        if delta.prompt_logprobs is not None and self._top_n is not None:
            first = TokenLogprob(token_id=token_ids[0], logprob=None, top=None)
            prompt_entries = [TokenLogprob(e.token_id, e.logprob, e.top[: self._top_n])
                              for e in delta.prompt_logprobs[1:]]
            logprobs = [first, *prompt_entries, *(logprobs or ())]
        return dataclasses.replace(delta, text=text + delta.text, logprobs=logprobs)


def _parse(request: web.Request, body: dict[str, Any], model: Model) -> CompletionRequest:
    return parse_request(COMPLETIONS_ENDPOINT, body, request_id=request[REQUEST_ID],
                         fields=request.config_dict[FIELD_POLICY])


async def _answer(request: web.Request, typed: CompletionRequest, model: Model, handles: list[Handle]):
    builder = CompletionBuilder(request_id=typed.id, model=model.name, token_bytes=model.token_bytes)
    echo = Echo.of(typed, handles, model) if typed.echo else None
    if typed.return_token_ids:
        builder.return_token_ids(handles)
    if typed.stream:
        plain = plain_chunks(builder, typed.include_usage)
        chunks = plain if echo is None else (lambda index, delta: plain(index, echo.apply(index, delta)))
        return await stream(request, handles, builder, include_usage=typed.include_usage, chunks=chunks)
    collected = await collect(request, handles, with_logprobs=typed.logprobs is not None,
                              read=None if echo is None else echo.apply)
    choices = []
    for index, text in collected.texts.items():
        choice = builder.choice(index, text, collected.finish_reasons.get(index), collected.logprobs[index])
        builder.with_token_ids(choice, index, collected.token_ids[index])
        if typed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(builder, typed.prompt_logprobs,
                                                             collected.prompt_logprobs.get(index))
        choices.append(choice)
    return web.json_response(builder.whole(choices, total_usage(handles)))


@routes.post("/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, _parse, _answer)
