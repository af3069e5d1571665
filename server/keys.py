"""Typed keys for what the aiohttp application holds (no module globals)."""

from __future__ import annotations

import pluggy
from aiohttp import web

from lockgate.engine import Usage
from lockgate.memory import Trimmer
from lockgate.metrics import Metrics
from lockgate.models.fleet import ModelFleet
from lockgate.plugin_api.fields import FieldPolicy
from lockgate.plugin_api.request import GenerationRequest
from lockgate.server.config import Settings

PLUGIN_MANAGER = web.AppKey("plugin_manager", pluggy.PluginManager)
SETTINGS = web.AppKey("settings", Settings)
#: the models served and their lifecycle
MODELS = web.AppKey("models", ModelFleet)
METRICS = web.AppKey("metrics", Metrics)
TRIMMER = web.AppKey("trimmer", Trimmer)
#: which request fields beyond the field tables are accepted (plugins', and
#: any with `--accept-unknown-fields`)
FIELD_POLICY = web.AppKey("field_policy", FieldPolicy)

#: an API's sub-app: how it writes an error answer as a body (`protocol.ErrorWriter`);
#: the root app and `/v1` write OpenAI's
ERROR_WRITER = web.AppKey("error_writer", object)

#: per-request: the id and the parsed request the hooks see
REQUEST_ID = web.RequestKey("lockgate_request_id", str)
PIPELINE_REQUEST = web.RequestKey("lockgate_pipeline_request", GenerationRequest)
#: per-request: the exception it was answered for and the answer (an
#: `ErrorResponse`), if any
ERROR_ANSWER = web.RequestKey("lockgate_error_answer", tuple)
#: per-request: set when the request counter counts it (the API's requests)
COUNTED = web.RequestKey("lockgate_counted", bool)
#: per-request: the handles of its admitted work (for response headers)
HANDLES = web.RequestKey("lockgate_handles", list)
#: per-request: token counts for the summary line
USAGE = web.RequestKey("lockgate_usage", Usage)
#: per-request: set when the client left mid-answer (its summary line and counter say 499)
CLIENT_LEFT = web.RequestKey("lockgate_client_left", bool)
#: per-request: its holds on the models it uses (`ModelFleet.acquire`), released when it ends
LEASES = web.RequestKey("lockgate_leases", list)
