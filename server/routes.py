"""HTTP handlers. They parse the body, run the pipeline and write the answer;
every step of request logic lives in plugins, every error answer in the
error middleware."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lockgate.engine import RequestHandle, Usage
from lockgate.errors import InvalidRequestError, ModelNotFound, Unavailable, UnsupportedMediaType
from lockgate.plugin_api.pipeline import run_pipeline
from lockgate.plugin_api.request import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, Request
from lockgate.server.keys import METRICS, MODELS, PIPELINE_REQUEST, PLUGIN_MANAGER, REQUEST_ID, USAGE
from lockgate.server.middlewares import error_response
from lockgate.server.responses import ResponseBuilder

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


class ClientTooSlow(Exception):
    """A streaming client fell `STREAM_BACKLOG_LIMIT` deltas behind."""


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else (413 comes from aiohttp).

    The body must be declared JSON (415 otherwise): besides saying what the
    server reads, this keeps a web page from posting to the API without the
    CORS preflight that `--allowed-origins` governs, since a browser sends
    form and text bodies cross-origin unasked.
    """
    content_type = request.content_type  # application/octet-stream when absent
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise UnsupportedMediaType(
            f"the request body must be JSON, sent with 'Content-Type: application/json' "
            f"(got {request.headers.get('Content-Type', 'no Content-Type')!r})"
        )
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "") != "utf8":
        raise UnsupportedMediaType(f"JSON bodies must be UTF-8, not {charset!r}")
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if _MAY_HOLD_SURROGATE.search(raw):
        reject_unencodable_strings(body)
    return body


# JSON's \uD800-\uDFFF escapes are the only way a body that decoded as UTF-8
# can carry a surrogate; a paired one decodes to a proper character.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def reject_unencodable_strings(body: dict[str, Any]) -> None:
    """Refuse a body any of whose strings, keys included, holds an unpaired
    surrogate (`"\\ud800"`): Python's JSON parser accepts it, but no later
    stage can (the tokenizer, the grammar compiler and the detokenizer raise,
    UTF-8 cannot encode it). Checked once here, on the whole body, so every
    string the pipeline hands onward is encodable whatever field it came in.

    :raises InvalidRequestError: (400) with `param` the field's path, as
        `messages[2].content[0].text`.
    """
    # depth first, in document order, without recursion (bodies nest deep)
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _require_encodable(value, path)
        elif isinstance(value, dict):
            for key in value:
                _require_encodable(key, path, key=True)
            stack.extend((f"{path}.{key}" if path else key, item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", value[i]) for i in reversed(range(len(value))))


def _require_encodable(text: str, path: str, *, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"a key of {path}" if key and path else "a key of the body" if key else path
        surrogate = ord(text[exc.start])
        raise InvalidRequestError(
            f"{where} is not valid Unicode: it holds an unpaired surrogate "
            f"(\\u{surrogate:04x}) at character {exc.start}",
            param=path or None,
        ) from None


def split_prompts(request_id: str, endpoint: str, body: dict[str, Any]) -> list[Request]:
    """One pipeline request per prompt (completions may carry a list of prompts)."""
    if endpoint == CHAT_ENDPOINT:
        return [Request(id=request_id, endpoint=endpoint, body=body)]
    prompt = body.get("prompt")
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        prompts = [prompt]
    return [
        Request(
            id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            endpoint=endpoint,
            body=body,
            prompt=p,
            choice_offset=i * max(n, 1),
        )
        for i, p in enumerate(prompts)
    ]


def _close_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _MergedDeltas:
    """The deltas of all handles of one HTTP request, as they come.

    Pumping starts at construction, before anything is written, so that a
    client that never reads is noticed even while the first write waits:
    with a `backlog_limit` (streams), past that many unread deltas the
    request is aborted. Iterating stops early, with `ConnectionResetError`,
    if the client leaves.
    """

    _DONE = object()

    def __init__(
        self, request: web.Request, handles: list[RequestHandle], *, backlog_limit: int | None = None
    ) -> None:
        self._request = request
        self._handles = handles
        self._backlog_limit = backlog_limit
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(h)) for h in handles]

    async def _pump(self, handle: RequestHandle) -> None:
        queue = self._queue
        try:
            async for delta in handle:
                await queue.put(delta)
                if self._backlog_limit is None:
                    continue
                # let the writer take it: deltas pile up only while it waits
                # on a client that does not read
                await asyncio.sleep(0)
                if queue.qsize() > self._backlog_limit:
                    # stop generating for it rather than buffer without end
                    log.warning("client too slow: request aborted", backlog=queue.qsize())
                    for each in self._handles:
                        each.abort()
                    raise ClientTooSlow(f"more than {self._backlog_limit} deltas unread")
        except Exception as exc:
            await queue.put(exc)
        await queue.put(self._DONE)

    async def __aiter__(self):
        remaining = len(self._tasks)
        try:
            while remaining:
                try:
                    item = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_SECONDS)
                except TimeoutError:
                    if _client_gone(self._request):
                        raise ConnectionResetError("the client disconnected") from None
                    continue
                if item is self._DONE:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def _usage(handles: list[RequestHandle]) -> Usage:
    usage = Usage(prompt_tokens=0)
    for handle in handles:
        usage.prompt_tokens += handle.usage.prompt_tokens
        usage.completion_tokens += handle.usage.completion_tokens
    return usage


async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    body = await read_json_body(request)
    model = request.app[MODELS].resolve(body.get("model"))
    request_id = request[REQUEST_ID]
    pipeline_requests = split_prompts(request_id, endpoint, body)
    request[PIPELINE_REQUEST] = pipeline_requests[0]
    # everything that can refuse the request runs before a byte is sent
    handles = await run_pipeline(request.app[PLUGIN_MANAGER], pipeline_requests, model)
    builder = ResponseBuilder(
        chat=endpoint == CHAT_ENDPOINT, request_id=request_id, model=model.name,
        token_bytes=model.token_bytes,
    )
    try:
        if body.get("stream") is True:
            return await _stream(request, body, handles, builder)
        return await _collect(request, handles, builder)
    except ConnectionResetError:
        log.info("client disconnected while waiting for its completion")
        return web.Response(status=499)  # nginx's "client closed request", for the log
    finally:
        request[USAGE] = _usage(handles)
        for handle in handles:
            handle.abort()


async def _collect(request, handles, builder: ResponseBuilder) -> web.Response:
    texts: dict[int, list[str]] = {}
    finish_reasons: dict[int, str | None] = {}
    logprobs: dict[int, list | None] = {}
    for handle in handles:
        for i in range(handle.work.params.n):
            texts[handle.work.choice_offset + i] = []
            logprobs[handle.work.choice_offset + i] = None if handle.work.params.logprobs is None else []
    async for delta in _MergedDeltas(request, handles):
        texts[delta.index].append(delta.text)
        if delta.logprobs:
            logprobs[delta.index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish_reasons[delta.index] = delta.finish_reason
    joined = {index: "".join(parts) for index, parts in texts.items()}
    return web.json_response(builder.completion(joined, finish_reasons, _usage(handles), logprobs))


async def _stream(request, body, handles, builder: ResponseBuilder) -> web.StreamResponse:
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    response.enable_chunked_encoding()
    deltas = _MergedDeltas(request, handles, backlog_limit=STREAM_BACKLOG_LIMIT)
    await response.prepare(request)

    async def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        try:
            await asyncio.wait_for(response.write(f"data: {data}\n\n".encode()), STREAM_WRITE_TIMEOUT_SECONDS)
        except TimeoutError:
            # a client that stopped reading but keeps its connection open
            log.info("client stopped reading: its stream is closed")
            _close_connection(request)
            raise ConnectionResetError("the client stopped reading") from None

    try:
        return await _write_stream(request, response, send, deltas, handles, builder, include_usage)
    finally:
        deltas.close()


async def _write_stream(request, response, send, deltas, handles, builder, include_usage):
    try:
        if builder.chat:
            for handle in handles:
                for i in range(handle.work.params.n):
                    await send(builder.role_chunk(handle.work.choice_offset + i, include_usage))
        async for delta in deltas:
            # A token whose text is held back (an incomplete UTF-8 sequence, a
            # possible start of a stop string) still has its logprobs: they go
            # out now, in a chunk with empty text.
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                await send(builder.delta_chunk(delta, include_usage))
        if include_usage:
            await send(builder.usage_chunk(_usage(handles)))
    except ConnectionResetError:
        log.info("client disconnected mid-stream")
        return response
    except ClientTooSlow:
        log.info("client too slow: its stream is closed")
        _close_connection(request)
        return response
    except Exception as exc:
        # headers are gone: the error travels inside the stream
        answer = error_response(request, exc)
        try:
            await send(answer.body())
        except ConnectionResetError:
            return response
    try:
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT_ENDPOINT)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS_ENDPOINT)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [m.card() for m in request.app[MODELS]]})


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for model in request.app[MODELS]:
        if name == model.name or name in model.aliases:
            return web.json_response(model.card())
    raise ModelNotFound(f"The model '{name}' does not exist", param="model")


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    models = list(request.app[MODELS])
    if not models:
        raise Unavailable("the model is still loading")
    for model in models:
        if not model.engine.healthy:
            raise Unavailable(
                f"model {model.name} is not serving: "
                + (model.engine.unhealthy_reason or "the server is shutting down")
            )
    return web.json_response({"status": "ok", "models": {m.name: m.engine.stats() for m in models}})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
