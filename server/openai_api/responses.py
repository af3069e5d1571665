"""The OpenAI Responses API: `POST /v1/responses` (whole or streamed as
typed events), `GET` and `DELETE /v1/responses/{id}`, and the in-memory
store that `previous_response_id` continues from.

A Responses body is typed by `lockgate.plugin_api.responses` into a chat
request and runs through the same pipeline and engine as chat; this module
only speaks the Responses shapes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import secrets
import time
from typing import Any

import structlog
from aiohttp import web

from lockgate.engine import Handle
from lockgate.errors import ErrorResponse, LockgateError
from lockgate.models import Model
from lockgate.plugin_api.output import Output
from lockgate.plugin_api.decoding import decoding_for
from lockgate.plugin_api.readers import Message, string
from lockgate.plugin_api.request import ChatRequest
from lockgate.plugin_api.responses import ResponsesRequest, parse_responses_request
from lockgate.plugin_api.tool_calls import ToolCall
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.serving import MergedDeltas, event_stream, generate, total_usage, write_event

log = structlog.get_logger("lockgate.server")

routes = web.RouteTableDef()


class ResponseNotFound(LockgateError):
    """A response id this server does not hold (never stored, evicted, or
    stored with another API key) (404)."""

    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


@dataclasses.dataclass
class StoredResponse:
    body: dict[str, Any]
    #: the conversation it ended (without its instructions), for `previous_response_id`
    conversation: tuple[Message, ...]
    owner: str | None


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`:
    at most `capacity`, least recently used out, in memory (lost on restart)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, owner: str | None, *, param: str | None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise ResponseNotFound(
                f"No response with id '{response_id}' is stored here (it was never stored, was created with "
                "store: false or another API key, or has been evicted or deleted)",
                param=param,
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner, param=None)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


RESPONSE_STORE = web.AppKey("response_store", ResponseStore)


def owner_of(request: web.Request) -> str | None:
    """Who may see a stored response: a digest of the API key it was made with."""
    header = request.headers.get("Authorization", "")
    return hashlib.sha256(header.encode("utf-8", "surrogateescape")).hexdigest() if header else None


class ResponseObjectBuilder:
    """The response object and its output items for one request."""

    def __init__(self, typed: ResponsesRequest, model_name: str) -> None:
        self.typed = typed
        self.id = "resp_" + secrets.token_hex(16)
        self.model = model_name
        self.created_at = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]], usage=None, *, reasoning_tokens: int = 0,
                 incomplete: str | None = None, error: dict | None = None) -> dict[str, Any]:
        body = self.typed.body
        text_format = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": self.typed.instructions,
            "max_output_tokens": self.typed.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.typed.parallel_tool_calls,
            "previous_response_id": self.typed.previous_response_id,
            "reasoning": {"effort": self.typed.reasoning, "summary": None},
            "store": self.typed.store,
            "temperature": self.typed.temperature,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": self.typed.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.total_tokens,
            },
            "metadata": dict(self.typed.metadata),
            "user": self.typed.user,
        }

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        """The thinking before the answer, as a `reasoning` item: its text
        in `content` (as open-weight models' items carry it), no summary."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}

    @staticmethod
    def call_item(item_id: str, call: ToolCall, arguments: str | None = None, status: str = "completed"):
        return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
                "arguments": call.arguments if arguments is None else arguments, "status": status}


def _finished(typed: ResponsesRequest, builder: ResponseObjectBuilder, output: list[dict[str, Any]], read: Output,
              finish_reason: str | None, handles, store: ResponseStore, owner: str | None):
    """The final response object (cut short by `max_output_tokens` unless it
    made calls), kept in the store with its conversation when `store`."""
    cut_short = finish_reason == "length" and not read.calls
    final = builder.envelope("incomplete" if cut_short else "completed", output, total_usage(handles),
                             reasoning_tokens=read.reasoning_tokens,
                             incomplete="max_output_tokens" if cut_short else None)
    if typed.store:
        answer = Message("assistant", read.content, tool_calls=tuple(read.calls), reasoning=read.reasoning)
        store.put(builder.id, StoredResponse(final, (*typed.history, *typed.input, answer), owner))
    return final


def _parse(request: web.Request, body: dict[str, Any], model: Model) -> ChatRequest:
    """The body typed as a chat request, after the conversation it continues."""
    history: tuple[Message, ...] = ()
    previous = body.get("previous_response_id")
    if previous is not None:
        string(previous, "previous_response_id")
        store = request.config_dict[RESPONSE_STORE]
        history = store.get(previous, owner_of(request), param="previous_response_id").conversation
    return parse_responses_request(body, request_id=request[REQUEST_ID], history=history,
                                   fields=request.config_dict[FIELD_POLICY],
                                   thinks=model.reasoning_format is not None)


async def _answer(request: web.Request, chat: ChatRequest, model: Model, handles: list[Handle]):
    store, owner = request.config_dict[RESPONSE_STORE], owner_of(request)
    parser = decoding_for(chat, model).reader(handles[0].work.prompt_token_ids)
    typed: ResponsesRequest = chat.origin
    builder = ResponseObjectBuilder(typed, model.name)
    if typed.stream:
        return await _stream(request, typed, handles, builder, parser, store, owner)
    text, finish_reason = "", None
    async for _, delta in MergedDeltas(request, handles):
        text += delta.text
        finish_reason = delta.finish_reason or finish_reason
    read = parser.parse(text)
    output = [] if read.reasoning is None else [builder.reasoning_item("rs_" + secrets.token_hex(12), read.reasoning)]
    if read.content or not read.calls:
        output.append(builder.message_item("msg_" + secrets.token_hex(12), read.content))
    output += [builder.call_item("fc_" + secrets.token_hex(12), call) for call in read.calls]
    return web.json_response(_finished(typed, builder, output, read, finish_reason, handles, store, owner))


@routes.post("/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    return await generate(request, _parse, _answer)


class _TextItem:
    """An output item whose one text part streams: a `reasoning` item's
    `reasoning_text`, or a `message`'s `output_text`."""

    def __init__(self, kind: str, emit, builder: ResponseObjectBuilder) -> None:
        self.kind, self.emit, self.builder = kind, emit, builder
        self.id = ("rs_" if kind == "reasoning" else "msg_") + secrets.token_hex(12)
        self.part_type = "reasoning_text" if kind == "reasoning" else "output_text"
        self.event = "response.reasoning_text" if kind == "reasoning" else "response.output_text"
        self.text = ""
        self.index: int | None = None

    def item(self, status: str = "completed") -> dict[str, Any]:
        if self.kind == "reasoning":
            return self.builder.reasoning_item(self.id, self.text, status)
        return self.builder.message_item(self.id, self.text, status)

    def part(self) -> dict[str, Any]:
        part = {"type": self.part_type, "text": self.text}
        return part if self.kind == "reasoning" else {**part, "annotations": []}

    async def open(self, index: int) -> None:
        self.index = index
        await self.emit("response.output_item.added", output_index=index, item=self.item("in_progress"))
        await self.emit("response.content_part.added", item_id=self.id, output_index=index, content_index=0,
                        part={**self.part(), "text": ""})

    async def add(self, piece: str, index: int) -> None:
        if not piece:
            return
        if self.index is None:
            await self.open(index)
        self.text += piece
        extra = {} if self.kind == "reasoning" else {"logprobs": []}
        await self.emit(self.event + ".delta", item_id=self.id, output_index=self.index, content_index=0,
                        delta=piece, **extra)

    async def close(self) -> dict[str, Any]:
        extra = {} if self.kind == "reasoning" else {"logprobs": []}
        await self.emit(self.event + ".done", item_id=self.id, output_index=self.index, content_index=0,
                        text=self.text, **extra)
        await self.emit("response.content_part.done", item_id=self.id, output_index=self.index, content_index=0,
                        part=self.part())
        item = self.item()
        await self.emit("response.output_item.done", output_index=self.index, item=item)
        return item


async def _stream(request, typed, handles, builder: ResponseObjectBuilder, parser, store, owner):
    sequence = 0
    output: list[dict[str, Any]] = []

    async def write(response: web.StreamResponse, deltas: MergedDeltas) -> None:
        async def emit(kind: str, **fields) -> None:
            await emit_event(response, kind, **fields)

        thinking, message = _TextItem("reasoning", emit, builder), _TextItem("message", emit, builder)

        async def out(split) -> None:
            await thinking.add(split.reasoning, 0)
            if split.content and thinking.index is not None and message.index is None:
                output.append(await thinking.close())  # the answer has begun: the thinking is done
            await message.add(split.content, len(output))

        await emit("response.created", response=builder.envelope("in_progress", []))
        await emit("response.in_progress", response=builder.envelope("in_progress", []))
        reader = parser.stream()
        finish_reason, read = None, None
        async for _, delta in deltas:
            await out(reader.feed(delta.text))
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
                rest, read = reader.finish()
                await out(rest)
        if thinking.index is not None and message.index is None:
            output.append(await thinking.close())
        if message.text or not read.calls:
            if message.index is None:  # an empty answer is still one message
                await message.open(len(output))
            output.append(await message.close())
        for call in read.calls:
            index, item_id = len(output), "fc_" + secrets.token_hex(12)
            await emit("response.output_item.added", output_index=index,
                       item=builder.call_item(item_id, call, "", "in_progress"))
            await emit("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                       delta=call.arguments)
            await emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
                       arguments=call.arguments, name=call.name)
            output.append(builder.call_item(item_id, call))
            await emit("response.output_item.done", output_index=index, item=output[-1])
        final = _finished(typed, builder, output, read, finish_reason, handles, store, owner)
        await emit("response." + final["status"], response=final)

    async def emit_event(stream_response: web.StreamResponse, kind: str, **fields) -> None:
        nonlocal sequence
        event = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        await write_event(request, stream_response, json.dumps(event, ensure_ascii=False), event=kind)

    async def write_error(response: web.StreamResponse, answer: ErrorResponse) -> None:
        # headers are gone: the failure is an event of the stream
        failed = builder.envelope("failed", output, error={"code": answer.code or answer.type, "message": answer.message})
        await emit_event(response, "response.failed", response=failed)

    return await event_stream(request, handles, write, write_error)


@routes.get("/responses/{response_id}")
async def get_response(request: web.Request) -> web.Response:
    stored = request.config_dict[RESPONSE_STORE].get(request.match_info["response_id"], owner_of(request),
                                                     param="response_id")
    return web.json_response(stored.body)


@routes.delete("/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    request.config_dict[RESPONSE_STORE].delete(response_id, owner_of(request))
    return web.json_response({"id": response_id, "object": "response", "deleted": True})
