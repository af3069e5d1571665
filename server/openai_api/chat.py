"""`POST /v1/chat/completions`: a `chat.completion` whole, or streamed as
`chat.completion.chunk`s; the model's thinking (`reasoning_content`) and
tool calls read out of its text (`lockgate.plugin_api.output`), whole or as
they come."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lockgate.engine import Delta, Handle
from lockgate.engine.sampling import TokenLogprob
from lockgate.models import Model
from lockgate.plugin_api.output import Output, OutputReader
from lockgate.plugin_api.decoding import decoding_for
from lockgate.plugin_api.tool_calls import ToolCall
from lockgate.plugin_api.request import CHAT_ENDPOINT, ChatRequest, parse_request
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.openai_api.choices import (
    ChoicesBuilder, collect, json_string, plain_chunks, prompt_logprobs_body, stream,
)
from lockgate.server.serving import generate, sse_frame, total_usage

routes = web.RouteTableDef()


class ChatCompletionBuilder(ChoicesBuilder):
    """A `chat.completion` and its chunks."""

    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    ID_PREFIX = "chatcmpl-"

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        text = self.token_bytes.text

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

        return {
            "content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in entries
            ],
            "refusal": None,
        }

    def choice(self, index: int, output: Output, finish_reason: str | None, logprobs, *, thinks: bool):
        """A whole choice; one with calls has them in its message (its
        `content` null when it wrote no text beside them); a model that
        thinks (`thinks`) has its thinking as `reasoning_content`."""
        message: dict[str, Any] = {"role": "assistant", "content": output.content}
        if thinks:
            message["reasoning_content"] = output.reasoning
        if output.calls:
            message["content"] = output.content or None
            message["tool_calls"] = [call.as_openai() for call in output.calls]
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason}

    def delta_choice(self, index: int, delta: Delta) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
            "logprobs": self.logprobs(index, delta.logprobs),
            "finish_reason": delta.finish_reason,
        }

    def delta_choice_json(self, index: int, delta: Delta, reason: str) -> str:
        body = f'{{"content": {json_string(delta.text)}}}' if delta.text or delta.finish_reason is None else "{}"
        return f'{{"index": {index}, "delta": {body}, "logprobs": null, "finish_reason": {reason}}}'

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        """The first chunk of a choice: the assistant role, no text yet."""
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}], include_usage)

    def tool_call_chunks(self, index: int, calls: list[ToolCall], include_usage: bool) -> list[dict[str, Any]]:
        """A choice's calls as OpenAI streams them: per call, a first chunk
        with its index, id, type and name, then its arguments."""
        chunks = []
        for i, call in enumerate(calls):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            tail = {"index": i, "function": {"arguments": call.arguments}}
            for part in (head, tail):
                chunks.append(self.chunk(
                    [{"index": index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}],
                    include_usage,
                ))
        return chunks

    def finish_chunk(self, index: int, reason: str, include_usage: bool) -> dict[str, Any]:
        return self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}], include_usage)


def _parse(request: web.Request, body: dict[str, Any], model: Model) -> ChatRequest:
    return parse_request(CHAT_ENDPOINT, body, request_id=request[REQUEST_ID],
                         fields=request.config_dict[FIELD_POLICY], thinks=model.reasoning_format is not None)


async def _answer(request: web.Request, typed: ChatRequest, model: Model, handles: list[Handle]):
    builder = ChatCompletionBuilder(request_id=typed.id, model=model.name, token_bytes=model.token_bytes)
    # the thinking and the tool calls are read out of the text here
    parser = decoding_for(typed, model).reader(handles[0].work.prompt_token_ids)
    thinks = parser.reasoning is not None
    if thinks:
        builder.reasoning_tokens = 0
    if typed.return_token_ids:
        builder.return_token_ids(handles)
    if typed.stream:
        include_usage = typed.include_usage
        readers: dict[int, OutputReader] = {}

        def read_chunks(index: int, delta: Delta) -> list[bytes]:
            reader = readers.setdefault(index, parser.stream())
            chunks = _read_chunks(builder, reader, index, delta, include_usage)
            if builder.prompt_ids is not None and delta.token_ids:
                if not chunks:  # text held back: its tokens still go out
                    chunks = [builder.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": None}],
                                            include_usage)]
                builder.with_token_ids(chunks[0]["choices"][0], index, delta.token_ids)
            return [sse_frame(c) for c in chunks]

        chunks = plain_chunks(builder, include_usage) if parser.plain else read_chunks
        first = [builder.role_chunk(index, include_usage) for index in range(sum(h.n for h in handles))]
        if builder.prompt_ids is not None:
            first[0]["prompt_token_ids"] = builder.prompt_ids[0]
        return await stream(request, handles, builder, include_usage=include_usage, chunks=chunks, first=first)
    collected = await collect(request, handles, with_logprobs=typed.requested_logprobs() is not None)
    choices = []
    for index, text in collected.texts.items():
        output = parser.parse(text)
        if thinks:
            builder.reasoning_tokens += output.reasoning_tokens
        choice = builder.choice(index, output, collected.finish_reasons.get(index), collected.logprobs[index],
                                thinks=thinks)
        choices.append(builder.with_token_ids(choice, index, collected.token_ids[index]))
    body = builder.whole(choices, total_usage(handles))
    if typed.prompt_logprobs is not None:
        # the choices share one prompt: its logprobs once, as vLLM has them
        body["prompt_logprobs"] = prompt_logprobs_body(builder, typed.prompt_logprobs,
                                                       collected.prompt_logprobs.get(0))
    return web.json_response(body)


def _read_chunks(builder: ChatCompletionBuilder, reader: OutputReader, index: int, delta: Delta,
                 include_usage: bool) -> list[dict[str, Any]]:
    """The chunks of one delta of a choice whose text is read: its thinking
    as `reasoning_content` and its answer as `content`, each as soon as it is
    known to be that; a call goes out whole, once the choice has ended and
    its text is parsed."""
    split = reader.feed(delta.text)
    if delta.finish_reason is None:
        if split.reasoning or split.content or delta.logprobs:
            return [builder.chunk([_split_choice(builder, index, split, delta.logprobs)], include_usage)]
        return []
    rest, output = reader.finish()
    split += rest
    if builder.reasoning_tokens is not None:
        builder.reasoning_tokens += output.reasoning_tokens
    chunks = []
    if split.reasoning or split.content or delta.logprobs:
        chunks.append(builder.chunk([_split_choice(builder, index, split, delta.logprobs)], include_usage))
    chunks += builder.tool_call_chunks(index, output.calls, include_usage)
    chunks.append(builder.finish_chunk(index, "tool_calls" if output.calls else delta.finish_reason, include_usage))
    return chunks


def _split_choice(builder: ChatCompletionBuilder, index: int, split, logprobs) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if split.reasoning:
        delta["reasoning_content"] = split.reasoning
    if split.content or not split.reasoning:
        delta["content"] = split.content
    return {"index": index, "delta": delta, "logprobs": builder.logprobs(index, logprobs), "finish_reason": None}


@routes.post("/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, _parse, _answer)
