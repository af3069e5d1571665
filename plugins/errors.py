"""Built-in `lockgate_handle_exception`: lockgate's typed errors to OpenAI error bodies."""

from __future__ import annotations

import structlog

from lockgate.errors import ErrorResponse, LockgateError, internal_error_response
from lockgate.plugin_api.hookspecs import hookimpl

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
    log.error("unexpected error", exc_info=exception)
    return internal_error_response(request.id if request is not None else None)
