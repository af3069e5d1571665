"""What every route reads and how every error is answered.

* reading a body (`read_json_body`): JSON, UTF-8, an object, every string
  encodable;
* the answer to an exception (`error_response`, which asks the
  `lockgate_handle_exception` plugins), and its body: OpenAI's
  (`error_body`), or the one the API's sub-app writes (`ERROR_WRITER`,
  found by `error_body_for`).

Parsing a body into a typed request is the plugin API's
(`lockgate.plugin_api.request`): the hooks receive that object. The
endpoints' own shapes are their modules' (`lockgate.server.openai_api`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from lockgate.errors import (
    ErrorResponse,
    internal_error_response,
    InvalidRequestError,
    LockgateError,
    MethodNotAllowed,
    RequestTooLarge,
    RouteNotFound,
    UnsupportedMediaType,
)
from lockgate.models import Model
from lockgate.models.slots import Lease
from lockgate.server.keys import (
    ERROR_ANSWER, ERROR_WRITER, LEASES, MODELS, PIPELINE_REQUEST, PLUGIN_MANAGER, REQUEST_ID, SETTINGS,
)

log = structlog.get_logger("lockgate.server")

# ------------------------------------------------------------------ the model a request names


async def leased_model(request: web.Request, name: Any) -> Model:
    """The model a request's `model` names, loaded (it waits for a load, or
    gets a 503 with Retry-After before any byte) and held for the request's
    life (`request_lease` releases it when the request ends); 400 or 404
    for a missing or unknown name."""
    return (await request_lease(request, name)).model


async def request_lease(request: web.Request, name: Any) -> Lease:
    """`leased_model`'s lease (a protocol that says how long the model
    stays, Ollama's `keep_alive`, sets it on the lease)."""
    lease = await request.config_dict[MODELS].acquire(name)
    if LEASES not in request:
        request[LEASES] = []
    request[LEASES].append(lease)
    return lease


def keep_alive(request: web.Request, seconds: float | None) -> None:
    """How long the models of this request stay loaded once idle: seconds
    (0: unload as soon as idle; negative: for good); None leaves the TTL."""
    if seconds is not None:
        for lease in request.get(LEASES, ()):
            lease.keep_alive = seconds


def release_leases(request: web.Request) -> None:
    """The request has ended: its models may unload."""
    for lease in request.get(LEASES, ()):
        lease.release()


# ------------------------------------------------------------------ request bodies


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


# ------------------------------------------------------------------ error bodies


def error_body(answer: ErrorResponse) -> dict[str, Any]:
    """An error answer as the OpenAI API writes it: `{"error": {message, type, param, code}}`."""
    return {
        "error": {
            "message": answer.message,
            "type": answer.type,
            "param": answer.param,
            "code": answer.code,
        }
    }


#: writes an error answer as an API's body; an application carries its own
#: under `ERROR_WRITER`, and the innermost one a request was routed through
#: is used (the OpenAI body where none is)
ErrorWriter = Callable[[ErrorResponse], dict[str, Any]]


def named_message(answer: ErrorResponse) -> str:
    """The answer's message led by the field it names, for an API whose
    error body has no `param` (Anthropic's, Ollama's); as it is where it
    names none or already starts with it."""
    if answer.param is None or answer.message.startswith(answer.param):
        return answer.message
    return f"{answer.param}: {answer.message}"


def error_body_for(request: web.Request, answer: ErrorResponse) -> dict[str, Any]:
    """The error body in the shape of the API the request was routed to:
    the innermost application's `ERROR_WRITER` (a sub-app's, as Anthropic's
    under `/v1/messages`), OpenAI's where none is set."""
    for app in reversed(request.match_info.apps):
        writer = app.get(ERROR_WRITER)
        if writer is not None:
            return writer(answer)
    return error_body(answer)


# ------------------------------------------------------------------ errors


def error_response(request: web.Request, exc: BaseException) -> ErrorResponse:
    """How to answer `exc`: the `lockgate_handle_exception` plugins are
    asked once per exception, and the answer is kept on the request (for
    the request counter and the summary log line). Never raises."""
    known = request.get(ERROR_ANSWER)
    if known is not None and known[0] is exc:
        return known[1]
    error = error_from_http_exception(request, exc) if isinstance(exc, web.HTTPException) else exc
    answer = _ask_plugins(request, error)
    request[ERROR_ANSWER] = (exc, answer)
    return answer


def _ask_plugins(request: web.Request, exc: BaseException) -> ErrorResponse:
    pipeline_request = request.get(PIPELINE_REQUEST)
    pm = request.config_dict[PLUGIN_MANAGER]
    try:
        answer = pm.hook.lockgate_handle_exception(exception=exc, request=pipeline_request)
        if isinstance(answer, ErrorResponse):
            return answer
        log.error("lockgate_handle_exception returned no ErrorResponse", returned=repr(answer))
    except Exception:
        log.exception("a lockgate_handle_exception implementation raised")
    return internal_error_response(request.get(REQUEST_ID))


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
        limit = request.config_dict[SETTINGS].max_body_size
        return RequestTooLarge(f"The request body is larger than the limit of {limit} bytes")
    error = InvalidRequestError(exc.text or exc.reason) if exc.status < 500 else LockgateError(exc.reason)
    error.status = exc.status
    return error
