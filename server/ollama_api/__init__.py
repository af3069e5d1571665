"""Ollama's API, a sub-app at `/api` on the same serving base: `/api/version`,
`/api/tags`, `/api/show`, `/api/ps` (`models`), `/api/chat` and
`/api/generate` (`generate`), `/api/embed` (`embed`), for the tools that
speak only Ollama. The
sub-app carries Ollama's error body (`{"error": "..."}`, the status as
lockgate's error contract gives it) and, like `/v1`, the API key and the
request counter. Bodies are typed by `lockgate.plugin_api.ollama`."""

from __future__ import annotations

from aiohttp import web

from lockgate.server.keys import ERROR_WRITER
from lockgate.server.middlewares import api_key_middleware, count_requests_middleware
from lockgate.server.ollama_api import embed, generate, models

#: where the sub-app is mounted on the root app
PREFIX = "/api"


def ollama_app(max_body_size: int) -> web.Application:
    app = web.Application(middlewares=[count_requests_middleware, api_key_middleware],
                          client_max_size=max_body_size)
    app[ERROR_WRITER] = generate.error_body
    app.add_routes(models.routes)
    app.add_routes(generate.routes)
    app.add_routes(embed.routes)
    return app
