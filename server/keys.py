"""Typed keys for what the aiohttp application holds (no module globals)."""

from __future__ import annotations

import pluggy
from aiohttp import web

from lockgate.metrics import Metrics
from lockgate.models import ServedModels
from lockgate.server.config import Settings

PLUGIN_MANAGER = web.AppKey("plugin_manager", pluggy.PluginManager)
SETTINGS = web.AppKey("settings", Settings)
MODELS = web.AppKey("models", ServedModels)
METRICS = web.AppKey("metrics", Metrics)

#: per-request: the id and the pipeline's `lockgate.types.Request`
REQUEST_ID = "lockgate_request_id"
PIPELINE_REQUEST = "lockgate_pipeline_request"
#: per-request: the `type` of the error it was answered with, if any
ERROR_TYPE = "lockgate_error_type"
#: per-request: token counts (`lockgate.engine.Usage`) for the summary line
USAGE = "lockgate_usage"
