"""Anthropic's Messages API, a sub-app at `/v1/messages` (`POST
/v1/messages`, `POST /v1/messages/count_tokens`), for Claude-style clients,
over the same serving skeleton as the OpenAI API (`lockgate.server.serving`).
The sub-app carries its own error writer, so every error under it, a 404
included, comes in Anthropic's envelope."""

from __future__ import annotations

from aiohttp import web

from lockgate.server.anthropic_api import messages
from lockgate.server.keys import ERROR_WRITER

#: where the sub-app is mounted, relative to `/v1`
PREFIX = "/messages"


def messages_app(max_body_size: int) -> web.Application:
    """The Messages API as a sub-app (mounted under `/v1`, whose API key and
    request counter apply to it)."""
    app = web.Application(client_max_size=max_body_size)
    app[ERROR_WRITER] = messages.error_body
    app.add_routes(messages.routes)
    return app
