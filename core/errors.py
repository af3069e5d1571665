"""Typed errors. Code raises these; the error middleware alone turns them into
HTTP responses (through the `lockgate_handle_exception` hook).

Each class carries the OpenAI error fields it answers with: HTTP status,
`type` and default `code`. `param` names the offending request field. Code
that knows no request fields (the engine) names the `subject` of the error
instead, in its own terms ("prompt", "max_tokens", "n", ...); the pipeline
turns it into the field of the request at hand (`messages` or `prompt`,
`max_completion_tokens` or `max_tokens`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class LockgateError(Exception):
    """Base of every error lockgate answers with its own status and message."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    #: what the error is about, in the terms of code that knows no request
    #: fields; None: the class names no subject of its own
    subject: str | None = None
    #: with a value, the answer carries `Retry-After` (seconds; `retry_after=`
    #: overrides it per error)
    retry_after: int | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        subject: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if subject is not None:
            self.subject = subject
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})
        retry_after = self.retry_after if retry_after is None else retry_after
        if retry_after is not None:
            self.headers.setdefault("Retry-After", str(retry_after))

    def __reduce__(self):
        # Exception pickles its args alone, which would lose param, code and
        # headers; an error raised in another process (a Ray replica) must
        # arrive as the same answer.
        return (_rebuild_error, (type(self), self.message, dict(self.__dict__)))


def _rebuild_error(cls: type[LockgateError], message: str, state: dict[str, Any]) -> LockgateError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InvalidRequestError(LockgateError):
    """The request is malformed or asks for something out of range (400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class InvalidMessages(InvalidRequestError):
    """The chat template refused the conversation (400)."""

    code = "invalid_messages"


class ContextLengthExceeded(InvalidRequestError):
    """Prompt plus requested completion does not fit the context (400)."""

    code = "context_length_exceeded"


class TooManyChoices(InvalidRequestError):
    """`n` is over what the engine allows (400)."""

    subject = "n"


class ChoicesExceedCache(InvalidRequestError):
    """All `n` choices at their longest would not fit the KV cache even alone (400)."""

    subject = "n"


class TokenOutsideVocabulary(InvalidRequestError):
    """A token id (prompt, logit_bias, stop_token_ids) the model does not have (400)."""


class InvalidSchema(InvalidRequestError):
    """A `response_format` schema or grammar is invalid (400)."""

    code = "invalid_schema"


class UnsupportedParameter(InvalidRequestError):
    """A valid OpenAI parameter this server cannot honour yet (400)."""

    code = "unsupported_parameter"


class UnknownParameter(InvalidRequestError):
    """A request field no row of the endpoint's field table names (400), as
    OpenAI answers one ("Unrecognized request argument supplied: ...")."""

    code = "unknown_parameter"


class AuthenticationError(LockgateError):
    """Missing or wrong API key (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class OriginNotAllowed(LockgateError):
    """A browser's CORS preflight from an origin not in `--allowed-origins` (403)."""

    status = 403
    type = "permission_error"
    code = "origin_not_allowed"


class ModelNotFound(LockgateError):
    """The request names a model this server does not serve (404)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(LockgateError):
    """No such route (404)."""

    status = 404
    type = "invalid_request_error"
    code = None


class MethodNotAllowed(LockgateError):
    """The route exists but not for this method (405)."""

    status = 405
    type = "invalid_request_error"
    code = None


class RequestTooLarge(LockgateError):
    """The body is over the configured size limit (413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(LockgateError):
    """The body is not declared as JSON (415)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Overloaded(LockgateError):
    """The waiting queue is full (429, with Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "server_busy"
    retry_after = 1


class Unavailable(LockgateError):
    """The engine is unhealthy or shutting down (503, with Retry-After)."""

    status = 503
    type = "server_error"
    code = "unavailable"
    retry_after = 5


class InternalError(LockgateError):
    """Something failed that is not the client's fault (500).

    The message is generic; details go to the log, never to the client.
    """


class ModelLoadError(Exception):
    """A model file or its metadata cannot be used. Raised at start-up, not
    while serving, so it is not an HTTP error."""


class PluginError(Exception):
    """A plugin is malformed (for example an `async def` hook implementation)."""


@dataclasses.dataclass
class ErrorResponse:
    """An OpenAI-style error answer, built by `lockgate_handle_exception`."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)



def internal_error_response(request_id: str | None = None) -> ErrorResponse:
    """The one answer to a failure that is not the client's (500): a generic
    message naming the request id (the request's, or the one bound for
    logging), never the failure itself, which goes to the log."""
    if request_id is None:
        import structlog

        request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ErrorResponse(
        status=500,
        message=f"The server had an error while processing your request (request id {request_id}).",
        type="server_error",
        code="internal_error",
    )
