"""Built-in `lockgate_handle_exception`: lockgate's typed errors to OpenAI error bodies."""

from __future__ import annotations

import structlog

from lockgate.errors import LockgateError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.errors import ErrorResponse

log = structlog.get_logger("lockgate.errors")


@hookimpl(trylast=True)
def lockgate_handle_exception(exception, request):
    if isinstance(exception, LockgateError):
        return ErrorResponse(
            status=exception.status,
            message=exception.message,
            type=exception.type,
            param=exception.param,
            code=exception.code,
            headers=dict(exception.headers),
        )
    request_id = request.id if request is not None else structlog.contextvars.get_contextvars().get("request_id")
    log.error("unexpected error", exc_info=exception)
    return ErrorResponse(
        status=500,
        message=f"The server had an error while processing your request (request id {request_id}).",
        type="server_error",
        code="internal_error",
    )
