"""Typed keys for what the aiohttp application holds (no module globals)."""

from __future__ import annotations

import pluggy
from aiohttp import web

from lockgate.models import ServedModels
from lockgate.server.config import Settings

PLUGIN_MANAGER = web.AppKey("plugin_manager", pluggy.PluginManager)
SETTINGS = web.AppKey("settings", Settings)
MODELS = web.AppKey("models", ServedModels)

#: per-request: the id and the pipeline's `lockgate.types.Request`
REQUEST_ID = "lockgate_request_id"
PIPELINE_REQUEST = "lockgate_pipeline_request"
