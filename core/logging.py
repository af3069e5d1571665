"""structlog set-up: console lines on a TTY, JSON lines otherwise, with contextvars."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr.

    `fmt` is "console", "json" or "auto" (console when stderr is a TTY).
    Bound contextvars (`request_id`, ...) appear on every line.
    """
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *( [structlog.processors.format_exc_info] if fmt == "json" else [] ),
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log repeats lockgate's own per-request summary line
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
