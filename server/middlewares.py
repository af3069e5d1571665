"""Middlewares: request id and summary log line, the error middleware, CORS,
API keys.

The error middleware is the only place that turns exceptions into HTTP
responses. It asks `lockgate_handle_exception` (plugins first, the built-in
mapping last) and answers in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import structlog
from aiohttp import web

from lockgate.errors import (
    AuthenticationError,
    InvalidRequestError,
    LockgateError,
    MethodNotAllowed,
    OriginNotAllowed,
    RequestTooLarge,
    RouteNotFound,
)
from lockgate.errors import ErrorResponse
from lockgate.server.keys import (
    ERROR_TYPE,
    METRICS,
    PIPELINE_REQUEST,
    PLUGIN_MANAGER,
    REQUEST_ID,
    SETTINGS,
    USAGE,
)

log = structlog.get_logger("lockgate.server")

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: routes answered without an API key (and /metrics with --metrics-public)
OPEN_PATHS = frozenset({"/health"})
#: how long a browser may cache a preflight answer
CORS_MAX_AGE_SECONDS = 600


def new_request_id() -> str:
    return uuid.uuid4().hex


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Outermost: gives each request an id (the client's `x-request-id` if
    well-formed), binds it for logging, and writes one summary line."""
    client_id = request.headers.get("x-request-id", "")
    request_id = client_id if _CLIENT_REQUEST_ID.match(client_id) else new_request_id()
    request[REQUEST_ID] = request_id
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.monotonic()
    status = 0
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        if request.path.startswith("/v1/"):
            request.app[METRICS].count_request(status, request.get(ERROR_TYPE))
        usage = request.get(USAGE)
        log.info(
            "request",
            method=request.method,
            path=request.path,
            status=status,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            **({} if usage is None else usage.as_dict()),
            **({"error_type": request[ERROR_TYPE]} if ERROR_TYPE in request else {}),
        )
        structlog.contextvars.unbind_contextvars("request_id")


async def set_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every response, streamed or not, error or not,
    carries `x-request-id`."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


async def set_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every response to an allowed origin, streamed
    or not, error or not, carries the CORS headers a browser needs to read it."""
    origin = request.headers.get("Origin")
    if origin is not None and _origin_allowed(request, origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "x-request-id, Retry-After"
        response.headers.add("Vary", "Origin")


def _origin_allowed(request: web.Request, origin: str) -> bool:
    allowed = request.app[SETTINGS].allowed_origins
    return "*" in allowed or origin in allowed


@web.middleware
async def cors_preflight_middleware(request: web.Request, handler):
    """Answers browsers' CORS preflights (`OPTIONS` with
    `Access-Control-Request-Method`) before the API key is asked for, since a
    browser never sends credentials with one: 204 for an origin in
    `--allowed-origins`, 403 otherwise. The other responses get their CORS
    headers in `set_cors_headers`."""
    origin = request.headers.get("Origin")
    if request.method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in request.headers:
        return await handler(request)
    if not _origin_allowed(request, origin):
        raise OriginNotAllowed(
            f"the origin {origin} may not call this server; start it with --allowed-origins to allow it"
        )
    headers = {
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Max-Age": str(CORS_MAX_AGE_SECONDS),
    }
    requested = request.headers.get("Access-Control-Request-Headers")
    if requested:
        headers["Access-Control-Allow-Headers"] = requested
    return web.Response(status=204, headers=headers)


def error_from_http_exception(request: web.Request, exc: web.HTTPException) -> Exception:
    """aiohttp's own HTTP errors (routing, body size) as lockgate errors."""
    if exc.status == 404:
        return RouteNotFound(f"Unknown route: {request.method} {request.path}")
    if exc.status == 405:
        return MethodNotAllowed(
            f"Method {request.method} is not allowed for {request.path}",
            headers={"Allow": exc.headers.get("Allow", "")},
        )
    if exc.status == 413:
        limit = request.app[SETTINGS].max_body_size
        return RequestTooLarge(f"The request body is larger than the limit of {limit} bytes")
    error = InvalidRequestError(exc.text or exc.reason) if exc.status < 500 else LockgateError(exc.reason)
    error.status = exc.status
    return error


def error_response(request: web.Request, exc: BaseException) -> ErrorResponse:
    """Ask the plugins how to answer `exc`; never raises."""
    answer = _ask_plugins(request, exc)
    request[ERROR_TYPE] = answer.type
    return answer


def _ask_plugins(request: web.Request, exc: BaseException) -> ErrorResponse:
    pipeline_request = request.get(PIPELINE_REQUEST)
    pm = request.app[PLUGIN_MANAGER]
    try:
        answer = pm.hook.lockgate_handle_exception(exception=exc, request=pipeline_request)
        if isinstance(answer, ErrorResponse):
            return answer
        log.error("lockgate_handle_exception returned no ErrorResponse", returned=repr(answer))
    except Exception:
        log.exception("a lockgate_handle_exception implementation raised")
    return ErrorResponse(
        status=500,
        message="The server had an error while processing your request "
        f"(request id {request.get(REQUEST_ID)}).",
        type="server_error",
        code="internal_error",
    )


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every exception becomes an OpenAI-style JSON error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error: BaseException = error_from_http_exception(request, exc)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        error = exc
    answer = error_response(request, error)
    if answer.status >= 500:
        log.error("request failed", status=answer.status, error=repr(error))
    return web.json_response(answer.body(), status=answer.status, headers=answer.headers)


@web.middleware
async def api_key_middleware(request: web.Request, handler):
    """When API keys are configured, every route but `/health` (and
    `/metrics` with `--metrics-public`) needs `Authorization: Bearer <key>`;
    keys are compared in constant time and never logged."""
    settings = request.app[SETTINGS]
    keys = settings.api_keys
    open_path = request.path in OPEN_PATHS or settings.metrics_public and request.path == "/metrics"
    if keys and not open_path:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        # aiohttp keeps undecodable header bytes as surrogates: encode them back
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
        matched = False
        for key in keys:
            # no early exit: every key is compared whatever the outcome
            matched |= hmac.compare_digest(given_bytes, key.encode())
        if scheme.lower() != "bearer" or not matched:
            raise AuthenticationError(
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'."
                if header
                else "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
    return await handler(request)
