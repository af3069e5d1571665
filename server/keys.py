"""Typed keys for what the aiohttp application holds (no module globals)."""

from __future__ import annotations

import pluggy
from aiohttp import web

from lockgate.engine import Usage
from lockgate.metrics import Metrics
from lockgate.models import ServedModels
from lockgate.server.config import Settings
from lockgate.plugin_api.request import Request

PLUGIN_MANAGER = web.AppKey("plugin_manager", pluggy.PluginManager)
SETTINGS = web.AppKey("settings", Settings)
MODELS = web.AppKey("models", ServedModels)
METRICS = web.AppKey("metrics", Metrics)

#: per-request: the id and the pipeline's `lockgate.plugin_api.request.Request`
REQUEST_ID = web.RequestKey("lockgate_request_id", str)
PIPELINE_REQUEST = web.RequestKey("lockgate_pipeline_request", Request)
#: per-request: the `type` of the error it was answered with, if any
ERROR_TYPE = web.RequestKey("lockgate_error_type", str)
#: per-request: token counts for the summary line
USAGE = web.RequestKey("lockgate_usage", Usage)
