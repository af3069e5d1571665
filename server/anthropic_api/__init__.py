"""Anthropic's Messages API under `/v1` (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), for Claude-style clients, over the same
serving skeleton as the OpenAI API (`lockgate.server.serving`)."""

from __future__ import annotations

from lockgate.server.anthropic_api import messages

#: every route of the API, relative to `/v1`
ROUTES = [*messages.routes]
