"""`POST /v1/messages` in Anthropic's shape (whole, or streamed as its
event sequence) and `POST /v1/messages/count_tokens`, on the same serving
skeleton, pipeline, hooks and engine as chat. The body is typed by
`lockgate.plugin_api.messages`; the model's thinking and tool calls are read
out of its text (`lockgate.plugin_api.output`) and answered as `thinking` and
`tool_use` blocks. Errors come in
Anthropic's envelope from the error middleware (`protocol.error_body_for`),
and as an `error` event once a stream has begun."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from lockgate.engine import Handle, Usage
from lockgate.errors import ErrorResponse
from lockgate.models import Model
from lockgate.plugin_api.messages import parse_messages_request
from lockgate.plugin_api.request import ChatRequest
from lockgate.plugin_api.output import OutputParser
from lockgate.plugin_api.decoding import decoding_for
from lockgate.plugin_api.pipeline import count_prompt_tokens
from lockgate.plugin_api.tool_calls import ToolCall
from lockgate.server.keys import FIELD_POLICY, PLUGIN_MANAGER, REQUEST_ID
from lockgate.server.protocol import leased_model, named_message, read_json_body
from lockgate.server.serving import MergedDeltas, event_stream, generate, total_usage, write_event

#: the routes, relative to the sub-app at `/v1/messages`
routes = web.RouteTableDef()

#: Anthropic's error types by status (its API's own table; 503 is its overload)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(answer: ErrorResponse) -> dict[str, Any]:
    """An error answer as Anthropic's Messages API writes it:
    `{"type": "error", "error": {"type", "message"}}`, the type by status
    (any other 4xx `invalid_request_error`, any other 5xx `api_error`)."""
    default = "invalid_request_error" if answer.status < 500 else "api_error"
    kind = _ERROR_TYPES.get(answer.status, default)
    return {"type": "error", "error": {"type": kind, "message": named_message(answer)}}



def _stop_reason(finish_reason: str | None, stop_string: str | None, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


class MessageBuilder:
    """The `message` object and its content blocks for one request."""

    def __init__(self, typed: ChatRequest, model_name: str) -> None:
        self.id = "msg_" + typed.id
        self.model = model_name

    @staticmethod
    def usage(usage: Usage, output_tokens: int | None = None) -> dict[str, Any]:
        # input_tokens are those prefilled; the prefix cache's are cache reads
        return {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
        }

    def message(self, content: list[dict[str, Any]], usage: dict[str, Any], stop_reason: str | None = None,
                stop_sequence: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def thinking(text: str) -> dict[str, Any]:
        """The thinking as a `thinking` block. Its `signature` is empty:
        there is no Anthropic key behind it, and a client sending the
        block back gets it read as the turn's thinking, unchecked."""
        return {"type": "thinking", "thinking": text, "signature": ""}

    @staticmethod
    def tool_use(call: ToolCall) -> dict[str, Any]:
        """A call as a `tool_use` block. `input` is an object: arguments a
        format wrote as anything else (a grammar-free call can) are kept
        whole under "arguments" rather than dropped."""
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = call.arguments
        tool_input = arguments if isinstance(arguments, dict) else {"arguments": arguments}
        return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input}


def _parse(request: web.Request, body: dict[str, Any], model: Model) -> ChatRequest:
    return parse_messages_request(body, request_id=request[REQUEST_ID], thinks=model.reasoning_format is not None,
                                  fields=request.config_dict[FIELD_POLICY])


async def _answer(request: web.Request, typed: ChatRequest, model: Model, handles: list[Handle]):
    parser = decoding_for(typed, model).reader(handles[0].work.prompt_token_ids)
    builder = MessageBuilder(typed, model.name)
    if typed.stream:
        return await _stream(request, handles, builder, parser)
    text, finish_reason, stop_string = "", None, None
    async for _, delta in MergedDeltas(request, handles):
        text += delta.text
        if delta.finish_reason is not None:
            finish_reason, stop_string = delta.finish_reason, delta.stop_string
    read = parser.parse(text)
    content = [] if read.reasoning is None else [builder.thinking(read.reasoning)]
    if read.content or not (read.calls or read.reasoning):
        content.append({"type": "text", "text": read.content})
    content += [builder.tool_use(call) for call in read.calls]
    usage = builder.usage(total_usage(handles))
    return web.json_response(builder.message(content, usage, _stop_reason(finish_reason, stop_string, read.calls),
                                             stop_string))


async def _stream(request: web.Request, handles: list[Handle], builder: MessageBuilder, parser: OutputParser):
    """Anthropic's event sequence: `message_start`, `ping`, each content
    block's `content_block_start`, deltas (`thinking_delta`, `text_delta`, a
    tool's `input_json_delta`) and `content_block_stop`, then
    `message_delta` (stop reason, the whole usage) and `message_stop`."""

    async def emit(response: web.StreamResponse, kind: str, **fields) -> None:
        await write_event(request, response, json.dumps({"type": kind, **fields}, ensure_ascii=False), event=kind)

    async def write(response: web.StreamResponse, deltas: MergedDeltas) -> None:
        usage = total_usage(handles)
        await emit(response, "message_start", message=builder.message([], builder.usage(usage, output_tokens=0)))
        await emit(response, "ping")
        reader = parser.stream()
        index = 0
        #: the block being streamed: "thinking" or "text", or None
        open_block: str | None = None
        finish_reason, stop_string, calls = None, None, []

        async def block_out(kind: str, piece: str) -> None:
            nonlocal index, open_block
            if not piece:
                return
            if open_block != kind:
                if open_block is not None:
                    await emit(response, "content_block_stop", index=index)
                    index += 1
                open_block = kind
                start = builder.thinking("") if kind == "thinking" else {"type": "text", "text": ""}
                await emit(response, "content_block_start", index=index, content_block=start)
            delta = ({"type": "thinking_delta", "thinking": piece} if kind == "thinking"
                     else {"type": "text_delta", "text": piece})
            await emit(response, "content_block_delta", index=index, delta=delta)

        async def out(split) -> None:
            await block_out("thinking", split.reasoning)
            await block_out("text", split.content)

        async for _, delta in deltas:
            await out(reader.feed(delta.text))
            if delta.finish_reason is not None:
                finish_reason, stop_string = delta.finish_reason, delta.stop_string
                rest, read = reader.finish()
                await out(rest)
                calls = read.calls
        if open_block is not None:
            await emit(response, "content_block_stop", index=index)
            index += 1
        for call in calls:
            block = builder.tool_use(call)
            await emit(response, "content_block_start", index=index, content_block={**block, "input": {}})
            await emit(response, "content_block_delta", index=index,
                       delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            await emit(response, "content_block_stop", index=index)
            index += 1
        # the whole usage, as Anthropic sends it: the prefix cache's share of
        # the prompt is known only once the prompt was admitted
        await emit(response, "message_delta",
                   delta={"stop_reason": _stop_reason(finish_reason, stop_string, calls), "stop_sequence": stop_string},
                   usage=builder.usage(total_usage(handles)))
        await emit(response, "message_stop")

    async def write_error(response: web.StreamResponse, answer: ErrorResponse) -> None:
        await emit(response, "error", error=error_body(answer)["error"])

    return await event_stream(request, handles, write, write_error)


@routes.post("")
async def create_message(request: web.Request) -> web.StreamResponse:
    return await generate(request, _parse, _answer)


@routes.post("/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as `/v1/messages` would count them: the same
    parse, validation, template and tokenizer, nothing generated."""
    body = await read_json_body(request)
    model = await leased_model(request, body.get("model"))
    typed = parse_messages_request(body, request_id=request[REQUEST_ID], count_only=True,
                                   thinks=model.reasoning_format is not None,
                                   fields=request.config_dict[FIELD_POLICY])
    tokens = await count_prompt_tokens(request.config_dict[PLUGIN_MANAGER], typed, model)
    return web.json_response({"input_tokens": len(tokens)})

