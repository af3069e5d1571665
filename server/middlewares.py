"""Middlewares and response hooks: request id and summary log line, the
error middleware, CORS, API keys, the request counter.

The error middleware is the only place that turns exceptions into HTTP
responses; what it answers comes from `lockgate.server.protocol.error_response`
(the `lockgate_handle_exception` plugins, the built-in mapping last), in
OpenAI's error shape.

The root application carries the request id, error and CORS middlewares;
the `/v1` sub-application adds the API key and the request counter, so
those apply to the API by construction rather than by path.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import structlog
from aiohttp import web

from lockgate.errors import AuthenticationError, OriginNotAllowed
from lockgate.server.keys import COUNTED, ERROR_ANSWER, METRICS, REQUEST_ID, SETTINGS, USAGE
from lockgate.server.protocol import error_body, error_response, usage_body

log = structlog.get_logger("lockgate.server")

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
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
        usage = request.get(USAGE)
        error_type = _error_type(request)
        if request.get(COUNTED):
            request.app[METRICS].count_request(status, error_type)
        log.info(
            "request",
            method=request.method,
            path=request.path,
            status=status,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            **({} if usage is None else usage_body(usage)),
            **({} if error_type is None else {"error_type": error_type}),
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


def _error_type(request: web.Request) -> str | None:
    answer = request.get(ERROR_ANSWER)
    return None if answer is None else answer[1].type


def _origin_allowed(request: web.Request, origin: str) -> bool:
    allowed = request.config_dict[SETTINGS].allowed_origins
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


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every exception becomes an OpenAI-style JSON error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error: BaseException = exc
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        error = exc
    answer = error_response(request, error)
    if answer.status >= 500:
        log.error("request failed", status=answer.status, error=repr(error))
    return web.json_response(error_body(answer), status=answer.status, headers=answer.headers)


@web.middleware
async def count_requests_middleware(request: web.Request, handler):
    """Marks the request as one the request counter counts. The counting
    itself happens in `request_id_middleware`, the outermost, which alone
    sees the final status (an error answered by the error middleware, a
    client gone, a stream that failed after its headers)."""
    request[COUNTED] = True
    return await handler(request)


def require_api_key(request: web.Request) -> None:
    """When API keys are configured, the request must carry one as
    `Authorization: Bearer <key>`; keys are compared in constant time and
    never logged.

    :raises AuthenticationError: (401) when it does not.
    """
    keys = request.config_dict[SETTINGS].api_keys
    if not keys:
        return
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


@web.middleware
async def api_key_middleware(request: web.Request, handler):
    """Every route of the application it is installed on needs the API key
    (when keys are configured)."""
    require_api_key(request)
    return await handler(request)
