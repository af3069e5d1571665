"""The serving skeleton every generating endpoint runs on, whatever its
protocol: read the body, type it, run the pipeline (everything that can
refuse the request runs before a byte is sent), then write the answer whole
or as a stream of server-sent events, with the in-stream error tail once
the headers are gone; the request's handles are aborted and its usage noted
however it ends.

Embeddings run on `embed`: the same pipeline, their inputs pooled instead
of generated after.

An endpoint module (`lockgate.server.openai_api.chat`, `.completions`,
`.responses`) supplies only its protocol: how its body is typed
(`generate`'s `parse`) and how its answer is written (`answer`), with
`event_stream` for its events and its error event.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog
from aiohttp import web

from lockgate.engine import Handle, Usage
from lockgate.errors import ErrorResponse
from lockgate.models import Model
from lockgate.plugin_api.embeddings import EmbeddingPrompts, EmbeddingRequest, normalized
from lockgate.plugin_api.pipeline import run_pipeline
from lockgate.plugin_api.request import GenerationRequest
from lockgate.server.keys import CLIENT_LEFT, HANDLES, PIPELINE_REQUEST, PLUGIN_MANAGER, USAGE
from lockgate.server.protocol import error_response, leased_model, read_json_body

log = structlog.get_logger("lockgate.server")

#: how often a waiting handler checks whether its client is still there
DISCONNECT_POLL_SECONDS = 0.5
#: deltas a stream may hold unsent while its client does not read before its
#: request is aborted (the engine generates no further for it)
STREAM_BACKLOG_LIMIT = 512
#: seconds one write to a stream may wait for a client that does not read
#: before the connection is closed
STREAM_WRITE_TIMEOUT_SECONDS = 60.0

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


class MergedDeltas:
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


def total_usage(handles: list[Handle]) -> Usage:
    """The token counts of all of a request's handles."""
    return sum((handle.usage for handle in handles), Usage())




# ------------------------------------------------------------------ server-sent events


#: what a streamed answer is sent as: server-sent events (OpenAI's and
#: Anthropic's APIs), or a JSON object a line (Ollama's)
EVENT_STREAM, NDJSON = "text/event-stream", "application/x-ndjson"


async def open_event_stream(request: web.Request, handles: list[Handle], content_type: str = EVENT_STREAM):
    """Start a streamed answer: the response, prepared (the headers are
    gone), and the merged deltas of `handles`, read with the slow-reader
    limit."""
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    response.enable_chunked_encoding()
    deltas = MergedDeltas(request, handles, backlog_limit=STREAM_BACKLOG_LIMIT)
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


def sse_frame(payload: Any) -> bytes:
    """One server-sent event's bytes: `data: ` and the payload as JSON (a
    string as it is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


# ------------------------------------------------------------------ the skeleton

#: types a body (the model resolved) into the request the hooks see
Parse = Callable[[web.Request, dict[str, Any], Model], GenerationRequest]
#: writes the answer of a typed request from its handles
Answer = Callable[[web.Request, Any, Model, list[Handle]], Awaitable[web.StreamResponse]]


async def generate(request: web.Request, parse: Parse, answer: Answer,
                   model_name: Callable[[Any], Any] = lambda name: name) -> web.StreamResponse:
    """Serve one generating request: body, model (its `model` field as the
    protocol's `model_name` reads it), `parse`, the pipeline, then `answer`.
    Whatever happens after the pipeline, the handles are aborted (a no-op
    for finished ones) and the usage is noted for the request's log line; a
    client that left is logged as 499."""
    body = await read_json_body(request)
    model = await leased_model(request, model_name(body.get("model")))
    typed = parse(request, body, model)
    request[PIPELINE_REQUEST] = typed
    handles = await run_pipeline(request.config_dict[PLUGIN_MANAGER], typed, model)
    request[HANDLES] = handles
    try:
        return await answer(request, typed, model, handles)
    except ConnectionResetError:
        log.info("client disconnected while waiting for its completion")
        return web.Response(status=499)  # nginx's "client closed request", for the log
    finally:
        request[USAGE] = total_usage(handles)
        for handle in handles:
            handle.abort()


async def event_stream(
    request: web.Request,
    handles: list[Handle],
    write: Callable[[web.StreamResponse, MergedDeltas], Awaitable[None]],
    write_error: Callable[[web.StreamResponse, ErrorResponse], Awaitable[None]],
    content_type: str = EVENT_STREAM,
) -> web.StreamResponse:
    """Answer as a stream (server-sent events, or `NDJSON` lines): `write`
    writes it from the merged deltas; a failure once the headers are gone
    becomes the protocol's error event (`write_error`, given the answer the
    error middleware would have sent); a client that left or stopped
    reading ends it quietly."""
    response, deltas = await open_event_stream(request, handles, content_type)
    try:
        await write(response, deltas)
    except ConnectionResetError:  # gone, or too slow (ClientTooSlow)
        log.info("client disconnected mid-stream")
        request[CLIENT_LEFT] = True
        return response
    except Exception as exc:
        try:
            await write_error(response, error_response(request, exc))
        except ConnectionResetError:
            request[CLIENT_LEFT] = True
            return response
    finally:
        deltas.close()
    return await end_event_stream(response)


# ------------------------------------------------------------------ embeddings

#: inputs of one embeddings request in the engine at a time: a request of
#: thousands is enqueued a window at a time, so it neither fills the
#: engine's queue (whose limit would answer it 429) nor holds pages for
#: inputs the engine cannot reach yet
EMBEDDING_WINDOW = 64


async def pooled(request: web.Request, prompts: EmbeddingPrompts, model: Model, pooling: str,
                 truncate_to: int | None = None) -> tuple[list[np.ndarray], Usage]:
    """Serve the prompts of an embeddings or rerank request up to their
    answer: through the pipeline, a window at a time, each prompt's final
    hidden states pooled (`pooling`); the pooled vectors in the prompts'
    order and the usage. Handles are aborted however it ends and the usage
    noted for the request's log line."""
    request[PIPELINE_REQUEST] = prompts
    pm = request.config_dict[PLUGIN_MANAGER]
    vectors: list[np.ndarray] = []
    usage = Usage()
    count = len(prompts.prompts)
    try:
        for start in range(0, count, EMBEDDING_WINDOW):
            window = dataclasses.replace(prompts, id=prompts.id if count == 1 else f"{prompts.id}-{start}",
                                         prompts=prompts.prompts[start:start + EMBEDDING_WINDOW])
            handles = await run_pipeline(pm, window, model, pooling=pooling, truncate_to=truncate_to)
            try:
                for handle in handles:
                    async for delta in handle:
                        if delta.embedding is not None:
                            vectors.append(delta.embedding)
                    usage = usage + handle.usage
            finally:
                for handle in handles:
                    handle.abort()
    finally:
        request[USAGE] = usage
    return vectors, usage


async def embed(request: web.Request, typed: EmbeddingRequest, model: Model) -> tuple[list[np.ndarray], Usage]:
    """An embeddings request's vectors (pooled as the model pools,
    normalized) and usage, its `dimensions` checked against the model's."""
    typed.check_dimensions(model.config.hidden_size)
    vectors, usage = await pooled(request, typed.to_prompts(), model, model.pooling,
                                  typed.truncate_to(model.context_length))
    return [normalized(v) for v in vectors], usage
