"""`POST /api/chat` and `POST /api/generate` in Ollama's shape, on the same
serving skeleton, pipeline, hooks and engine as chat: whole, or streamed as
a JSON object a line (Ollama streams unless `stream` is false), the last
with `done: true`, the `done_reason` and the counts and durations (in
nanoseconds: `prompt_eval_duration` until the first token,
`eval_duration` after it). The model's thinking comes as `thinking` and its
calls as `tool_calls` with their arguments as objects. An error once the
stream has begun is a last line `{"error": ...}`, as Ollama writes it."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from aiohttp import web

from lockgate.engine import Handle
from lockgate.errors import ErrorResponse
from lockgate.models import Model
from lockgate.plugin_api.decoding import decoding_for
from lockgate.plugin_api.fields import OLLAMA_CHAT, OLLAMA_GENERATE
from lockgate.plugin_api.ollama import parse_ollama_request
from lockgate.plugin_api.output import Output
from lockgate.plugin_api.request import ChatRequest
from lockgate.plugin_api.tool_calls import ToolCall
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.protocol import keep_alive, leased_model, named_message, read_json_body
from lockgate.server.ollama_api.models import model_name, ollama_name
from lockgate.server.serving import NDJSON, MergedDeltas, event_stream, generate, total_usage, write_frames

routes = web.RouteTableDef()


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def error_body(answer: ErrorResponse) -> dict[str, Any]:
    """An error as Ollama writes it, whole or as a stream's last line: the
    message alone, led by the field it names. The sub-app's error writer."""
    return {"error": named_message(answer)}


def line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, ensure_ascii=False) + "\n").encode()


def call_body(call: ToolCall) -> dict[str, Any]:
    """A call as Ollama writes one: its arguments as an object."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = {"arguments": call.arguments}
    if not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    return {"function": {"name": call.name, "arguments": arguments}}


class Timing:
    """When the request came, and when its first output did."""

    def __init__(self) -> None:
        self.started = time.monotonic_ns()
        self.first: int | None = None

    def seen(self) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def final(self, handles: list[Handle], finish_reason: str | None) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        usage = total_usage(handles)
        return {"done": True, "done_reason": "length" if finish_reason == "length" else "stop",
                "total_duration": end - self.started, "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": first - self.started,
                "eval_count": usage.completion_tokens, "eval_duration": end - first}


def _answer_for(chat_shape: bool):
    """The answer of /api/chat (`chat_shape`: a `message`) or /api/generate
    (a `response` and `thinking`)."""

    def piece(model: Model, content: str, thinking: str, calls: list[ToolCall]) -> dict[str, Any]:
        if chat_shape:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [call_body(c) for c in calls]
            return {"model": ollama_name(model), "created_at": now(), "message": message}
        body = {"model": ollama_name(model), "created_at": now(), "response": content}
        if thinking:
            body["thinking"] = thinking
        return body

    async def answer(request: web.Request, typed: ChatRequest, model: Model, handles: list[Handle]):
        timing = Timing()
        parser = decoding_for(typed, model).reader(handles[0].work.prompt_token_ids)
        if typed.stream:
            return await _stream(request, handles, model, parser, timing, piece)
        text, finish_reason = "", None
        async for _, delta in MergedDeltas(request, handles):
            timing.seen()
            text += delta.text
            finish_reason = delta.finish_reason or finish_reason
        read: Output = parser.parse(text)
        body = piece(model, read.content, read.reasoning or "", read.calls)
        return web.json_response({**body, **timing.final(handles, finish_reason)})

    return answer


async def _stream(request, handles, model: Model, parser, timing: Timing, piece):
    async def write(response: web.StreamResponse, deltas: MergedDeltas) -> None:
        reader, finish_reason, calls = parser.stream(), None, []
        async for batch in deltas.batches():
            timing.seen()
            lines = []
            for _, delta in batch:
                split = reader.feed(delta.text)
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
                    rest, read = reader.finish()
                    split += rest
                    calls = read.calls
                if split.content or split.reasoning:
                    lines.append(line({**piece(model, split.content, split.reasoning, []), "done": False}))
            if lines:
                await write_frames(request, response, b"".join(lines))
        last = piece(model, "", "", calls)
        await write_frames(request, response, line({**last, **timing.final(handles, finish_reason)}))

    async def write_error(response: web.StreamResponse, answer: ErrorResponse) -> None:
        await write_frames(request, response, line(error_body(answer)))

    return await event_stream(request, handles, write, write_error, content_type=NDJSON)


def _parse_for(endpoint: str):
    def parse(request: web.Request, body: dict[str, Any], model: Model) -> ChatRequest:
        typed = parse_ollama_request(endpoint, body, request_id=request[REQUEST_ID],
                                     fields=request.config_dict[FIELD_POLICY])
        keep_alive(request, typed.keep_alive)
        return typed.to_chat(thinks=model.reasoning_format is not None, context_length=model.context_length)

    return parse


@routes.post("/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    return await generate(request, _parse_for(OLLAMA_CHAT), _answer_for(chat_shape=True), model_name)


@routes.post("/generate")
async def generate_text(request: web.Request) -> web.StreamResponse:
    """A prompt, or none: then, as Ollama answers a request that only loads
    the model, it is loaded and `done_reason` is "load", or with
    `keep_alive` 0 it unloads and `done_reason` is "unload" (the body
    checked all the same)."""
    body = await read_json_body(request)
    if not body.get("prompt"):
        model = await leased_model(request, model_name(body.get("model")))
        typed = parse_ollama_request(OLLAMA_GENERATE, body, request_id=request[REQUEST_ID],
                                     fields=request.config_dict[FIELD_POLICY])
        keep_alive(request, typed.keep_alive)
        return web.json_response({"model": ollama_name(model), "created_at": now(), "response": "", "done": True,
                                  "done_reason": "unload" if typed.keep_alive == 0 else "load"})
    return await generate(request, _parse_for(OLLAMA_GENERATE), _answer_for(chat_shape=False), model_name)
