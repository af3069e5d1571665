"""HTTP handlers. They read the body, run the pipeline and write the answer;
every step of request logic lives in plugins, every error answer in the
error middleware, every OpenAI shape in `lockgate.server.protocol`.

`v1_routes` make up the `/v1` sub-application (the API, behind the API key);
`routes` are the server's own (`/health`, `/metrics`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lockgate.engine import Handle, Usage
from lockgate.errors import ModelNotFound, Unavailable
from lockgate.plugin_api.pipeline import run_pipeline
from lockgate.plugin_api.request import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatRequest,
    GenerationRequest,
    parse_request,
)
from lockgate.server.keys import HANDLES, METRICS, MODELS, PIPELINE_REQUEST, PLUGIN_MANAGER, REQUEST_ID, SETTINGS, USAGE
from lockgate.server.middlewares import require_api_key
from lockgate.server.protocol import Echo, ResponseBuilder, error_body, error_response, model_card, read_json_body

log = structlog.get_logger("lockgate.server")

#: how often a waiting handler checks whether its client is still there
DISCONNECT_POLL_SECONDS = 0.5
#: deltas a stream may hold unsent while its client does not read before its
#: request is aborted (the engine generates no further for it)
STREAM_BACKLOG_LIMIT = 512
#: seconds one write to a stream may wait for a client that does not read
#: before the connection is closed
STREAM_WRITE_TIMEOUT_SECONDS = 60.0

routes = web.RouteTableDef()
v1_routes = web.RouteTableDef()


class ClientTooSlow(ConnectionResetError):
    """A streaming client fell `STREAM_BACKLOG_LIMIT` deltas behind: its
    request is aborted, and its connection closed once the writer reads
    this, which every writer then handles as a client gone."""


def _close_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _MergedDeltas:
    """The deltas of all handles of one HTTP request, as they come, each
    with the index of its choice in the response (handle `i`'s choices
    follow those of handles `0 .. i-1`).

    Reading starts at construction, before anything is written, so that a
    client that never reads is noticed even while the first write waits:
    with a `backlog_limit` (streams), past that many unread deltas the
    request is aborted. Iterating stops early, with `ConnectionResetError`,
    if the client leaves.

    Handles that can `subscribe` (the engine's own) hand their deltas over
    as the engine delivers them, with no task per handle; others (a plugin's
    handles) are read by a task each. `batches()` gives what arrived
    together as one list, so a stream can write it in one piece.
    """

    _DONE = object()

    def __init__(
        self, request: web.Request, handles: list[Handle], *, backlog_limit: int | None = None
    ) -> None:
        self._request = request
        self._handles = handles
        self._backlog_limit = backlog_limit
        self._loop = asyncio.get_running_loop()
        #: (index, delta) pairs, exceptions and _DONE markers, in arrival order
        self._items: collections.deque = collections.deque()
        self._unread = 0
        self._remaining = len(handles)
        self._waiter: asyncio.Future | None = None
        self._too_slow = False
        self._gone = False
        self._closed = False
        for handle, offset in zip(handles, choice_offsets(handles)):
            handle.subscribe(functools.partial(self._arrived, offset))
        self._poll = self._loop.call_later(DISCONNECT_POLL_SECONDS, self._check_client)

    def _arrived(self, offset: int, item: Any) -> None:
        """A handle's delta, None when it ended, or its exception."""
        if self._closed or self._too_slow:
            return
        if item is None:
            self._items.append(self._DONE)
        elif isinstance(item, BaseException):
            self._items.append(item)
        else:
            self._items.append((offset + item.index, item))
            self._unread += 1
            if self._backlog_limit is not None and self._unread > self._backlog_limit:
                # stop generating for it rather than buffer without end
                log.warning("client too slow: request aborted", backlog=self._unread)
                self._too_slow = True
                for each in self._handles:
                    each.abort()
                self._items.append(ClientTooSlow(f"more than {self._backlog_limit} deltas unread"))
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _check_client(self) -> None:
        if _client_gone(self._request):
            self._gone = True
            self._wake()
        elif not self._closed:
            self._poll = self._loop.call_later(DISCONNECT_POLL_SECONDS, self._check_client)

    async def batches(self):
        """Lists of (index, delta): what arrived since the last one."""
        items = self._items
        try:
            while True:
                batch = []
                while items:
                    item = items.popleft()
                    if item is self._DONE:
                        self._remaining -= 1
                    elif isinstance(item, BaseException):
                        self._unread -= len(batch)
                        if batch:
                            items.appendleft(item)
                            break
                        if isinstance(item, ClientTooSlow):  # the writer learns it now: the stream ends here
                            log.info("client too slow: its stream is closed")
                            _close_connection(self._request)
                        raise item
                    else:
                        batch.append(item)
                else:
                    self._unread -= len(batch)
                if batch:
                    yield batch
                    continue
                if not self._remaining:
                    return
                if self._gone:
                    raise ConnectionResetError("the client disconnected")
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        finally:
            self.close()

    async def __aiter__(self):
        async for batch in self.batches():
            for item in batch:
                yield item

    def close(self) -> None:
        self._closed = True
        self._poll.cancel()


def choice_offsets(handles: list[Handle]) -> list[int]:
    """Index in the response of each handle's first choice."""
    offsets, total = [], 0
    for handle in handles:
        offsets.append(total)
        total += handle.n
    return offsets


def _usage(handles: list[Handle]) -> Usage:
    return sum((handle.usage for handle in handles), Usage())


async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    body = await read_json_body(request)
    model = request.config_dict[MODELS].resolve(body.get("model"))
    typed = parse_request(endpoint, body, request_id=request[REQUEST_ID])
    request[PIPELINE_REQUEST] = typed
    # everything that can refuse the request runs before a byte is sent
    handles = await run_pipeline(request.config_dict[PLUGIN_MANAGER], typed, model)
    request[HANDLES] = handles
    builder = ResponseBuilder(
        chat=typed.is_chat, request_id=typed.id, model=model.name, token_bytes=model.token_bytes
    )
    # the model's tool calls are read out of its text here, by the tools offered
    tool_format = None
    if isinstance(typed, ChatRequest) and typed.reads_tool_output and model.tool_call_format is not None:
        tool_format = model.tool_call_format.with_tools(typed.offered_tools)
    echo = _echo(typed, handles, model) if typed.echoes_prompt else None
    try:
        if typed.stream:
            return await _stream(request, typed, handles, builder, tool_format, echo)
        return await _collect(request, typed, handles, builder, tool_format, echo)
    except ConnectionResetError:
        log.info("client disconnected while waiting for its completion")
        return web.Response(status=499)  # nginx's "client closed request", for the log
    finally:
        request[USAGE] = _usage(handles)
        for handle in handles:
            handle.abort()


def _echo(typed: CompletionRequest, handles: list[Handle], model) -> Echo:
    """Each choice's prompt, as sent (a token-id prompt decoded), for `echo`."""
    prompts = {}
    for one, handle, offset in zip(typed.split(), handles, choice_offsets(handles)):
        token_ids = handle.work.prompt_token_ids
        text = one.prompt if isinstance(one.prompt, str) else model.tokenizer.decode(
            token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for index in range(offset, offset + handle.n):
            prompts[index] = (text, token_ids)
    return Echo(prompts, typed.logprobs)


async def _collect(request, typed: GenerationRequest, handles, builder: ResponseBuilder, tool_format,
                   echo: Echo | None) -> web.Response:
    with_logprobs = typed.requested_logprobs() is not None
    texts: dict[int, list[str]] = {}
    finish_reasons: dict[int, str | None] = {}
    logprobs: dict[int, list | None] = {}
    for handle, offset in zip(handles, choice_offsets(handles)):
        for index in range(offset, offset + handle.n):
            texts[index] = []
            logprobs[index] = [] if with_logprobs else None
    prompt_logprobs: dict[int, list] = {}
    async for index, delta in _MergedDeltas(request, handles):
        if delta.prompt_logprobs is not None:
            prompt_logprobs[index] = delta.prompt_logprobs
        if echo is not None:
            delta = echo.apply(index, delta)
        texts[index].append(delta.text)
        if delta.logprobs:
            logprobs[index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish_reasons[index] = delta.finish_reason
    joined = {index: "".join(parts) for index, parts in texts.items()}
    calls: dict[int, list] = {}
    if tool_format is not None:
        for index, text in joined.items():
            parsed = tool_format.parse(text)
            joined[index], calls[index] = parsed.content or "", parsed.calls
            if parsed.calls:
                finish_reasons[index] = "tool_calls"
    extension = None if typed.prompt_logprobs is None else (typed.prompt_logprobs, prompt_logprobs)
    return web.json_response(builder.completion(joined, finish_reasons, _usage(handles), logprobs, calls, extension))


async def open_event_stream(request: web.Request, handles: list[Handle]):
    """Start a server-sent-event answer: the response, prepared (the
    headers are gone), and the merged deltas of `handles`, read with the
    slow-reader limit."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    response.enable_chunked_encoding()
    deltas = _MergedDeltas(request, handles, backlog_limit=STREAM_BACKLOG_LIMIT)
    await response.prepare(request)
    return response, deltas


async def write_event(request: web.Request, response: web.StreamResponse, data: str, event: str | None = None):
    """Write one event; a client that stopped reading but keeps its
    connection open has it closed (`ConnectionResetError`)."""
    frame = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
    await write_frames(request, response, frame.encode())


async def write_frames(request: web.Request, response: web.StreamResponse, frames: bytes) -> None:
    """Write encoded events in one piece, closing the connection of a
    client that stopped reading (`ConnectionResetError`)."""
    try:
        # a timeout scope, not wait_for: no task per write
        async with asyncio.timeout(STREAM_WRITE_TIMEOUT_SECONDS):
            await response.write(frames)
    except TimeoutError:
        log.info("client stopped reading: its stream is closed")
        _close_connection(request)
        raise ConnectionResetError("the client stopped reading") from None


async def end_event_stream(response: web.StreamResponse) -> web.StreamResponse:
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


def _frame(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _stream(
    request, typed: GenerationRequest, handles, builder: ResponseBuilder, tool_format, echo: Echo | None
) -> web.StreamResponse:
    response, deltas = await open_event_stream(request, handles)

    async def send(*payloads: Any) -> None:
        await write_frames(request, response, b"".join(_frame(payload) for payload in payloads))

    try:
        return await _write_stream(
            request, response, send, deltas, handles, builder, typed.include_usage, tool_format, echo
        )
    finally:
        deltas.close()


async def _write_stream(request, response, send, deltas, handles, builder, include_usage, tool_format,
                        echo=None):
    try:
        if builder.chat:
            await send(*(builder.role_chunk(index, include_usage) for index in range(sum(h.n for h in handles))))
        readers: dict[int, Any] = {}
        async for batch in deltas.batches():
            frames: list[bytes] = []
            for index, delta in batch:
                if echo is not None:
                    delta = echo.apply(index, delta)
                if tool_format is not None:
                    reader = readers.setdefault(index, tool_format.stream())
                    frames += map(_frame, _tool_stream_chunks(builder, reader, index, delta, include_usage))
                # A token whose text is held back (an incomplete UTF-8 sequence, a
                # possible start of a stop string) still has its logprobs: they go
                # out now, in a chunk with empty text.
                elif delta.text or delta.finish_reason is not None or delta.logprobs:
                    frames.append(_frame(builder.delta_chunk_json(index, delta, include_usage)))
            if frames:
                await write_frames(request, response, b"".join(frames))
        if include_usage:
            await send(builder.usage_chunk(_usage(handles)))
    except ConnectionResetError:  # gone, or too slow (ClientTooSlow)
        log.info("client disconnected mid-stream")
        return response
    except Exception as exc:
        # headers are gone: the error travels inside the stream
        answer = error_response(request, exc)
        try:
            await send(error_body(answer))
        except ConnectionResetError:
            return response
    try:
        await send("[DONE]")
    except ConnectionResetError:
        return response
    return await end_event_stream(response)


def _tool_stream_chunks(builder: ResponseBuilder, reader, index: int, delta, include_usage: bool) -> list:
    """The chunks of one delta of a choice that may call tools: text that
    cannot be part of a call goes out at once; a call goes out whole, once
    the choice has ended and its text is parsed."""
    text = reader.feed(delta.text)
    if delta.finish_reason is None:
        if text or delta.logprobs:
            return [builder.delta_chunk(index, dataclasses.replace(delta, text=text), include_usage)]
        return []
    parsed = reader.finish()
    text += parsed.content or ""
    chunks = []
    if text or delta.logprobs:
        chunks.append(builder.delta_chunk(index, dataclasses.replace(delta, text=text, finish_reason=None),
                                          include_usage))
    chunks += builder.tool_call_chunks(index, parsed.calls, include_usage)
    chunks.append(builder.finish_chunk(index, "tool_calls" if parsed.calls else delta.finish_reason, include_usage))
    return chunks


@v1_routes.post("/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT_ENDPOINT)


@v1_routes.post("/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS_ENDPOINT)


@v1_routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(m) for m in request.config_dict[MODELS]]})


@v1_routes.get("/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for model in request.config_dict[MODELS]:
        if name == model.name or name in model.aliases:
            return web.json_response(model_card(model))
    raise ModelNotFound(f"The model '{name}' does not exist", param="model")


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Open to all, API keys or not: load balancers and orchestrators probe it."""
    models = list(request.app[MODELS])
    if not models:
        raise Unavailable("the model is still loading")
    for model in models:
        if not model.engine.healthy:
            raise Unavailable(
                f"model {model.name} is not serving: "
                + (model.engine.unhealthy_reason or "the server is shutting down")
            )
    return web.json_response({"status": "ok", "models": {m.name: m.engine.stats().as_dict() for m in models}})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Behind the API key like the API (the figures tell load and traffic),
    unless `--metrics-public` opens it to a scraper that sends no key."""
    if not request.app[SETTINGS].metrics_public:
        require_api_key(request)
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
