"""The aiohttp application.

* `create_app(settings, pm=..., models=...)` for tests and embedding;
* `init_app(argv)` for aiohttp's launcher:
  `python -m aiohttp.web -H 127.0.0.1 -P 8000 lockgate.server.app:init_app`;
* `app_from_env()` for gunicorn:
  `gunicorn 'lockgate.server.app:app_from_env()' -k aiohttp.GunicornWebWorker`.

Settings come from `LOCKGATE_*` environment variables where not given.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import pluggy
import structlog
from aiohttp import web

from lockgate.logging import configure_logging
from lockgate.memory import Trimmer
from lockgate.metrics import Metrics
from lockgate.models import Model, load_served_model
from lockgate.models.fleet import ModelFleet
from lockgate.models.slots import ModelPlan
from lockgate.models.plans import model_plans
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.server.config import Settings, serve_parser, settings_from_args
from lockgate.settings import settings_table
from lockgate.plugin_api.fields import FieldPolicy
from lockgate.server.keys import FIELD_POLICY, METRICS, MODELS, PLUGIN_MANAGER, SETTINGS, TRIMMER

from lockgate.server.middlewares import (
    api_key_middleware,
    count_requests_middleware,
    cors_preflight_middleware,
    error_middleware,
    request_id_middleware,
    set_cors_headers,
    set_replica_header,
    set_request_id_header,
)
from lockgate.server import anthropic_api, ollama_api
from lockgate.server.openai_api import ROOT_ROUTES as OPENAI_ROOT_ROUTES, ROUTES as OPENAI_ROUTES
from lockgate.server.openai_api.responses import RESPONSE_STORE, ResponseStore
from lockgate.server.model_routes import model_routes
from lockgate.server.routes import routes
from lockgate.server.tokenizer_routes import tokenizer_routes

log = structlog.get_logger("lockgate.server")


def create_app(
    settings: Settings | None = None,
    *,
    pm: pluggy.PluginManager | None = None,
    models: Iterable[Model] | None = None,
) -> web.Application:
    """Build the application.

    With `models`, those (already loaded) models are served and left open at
    cleanup; otherwise the models `settings` name (`lockgate.models.plans`)
    are served: one is loaded at start-up, several each on first use, and
    all are closed at cleanup. Engines start with the app and stop with it.

    :raises InvalidSetting: settings that name no servable set of models.
    """
    settings = settings or Settings.from_env()
    pm = pm or get_plugin_manager()
    app = web.Application(
        middlewares=[request_id_middleware, error_middleware, cors_preflight_middleware],
        client_max_size=settings.max_body_size,
    )
    app[SETTINGS] = settings
    app[PLUGIN_MANAGER] = pm
    app[FIELD_POLICY] = FieldPolicy.from_plugins(pm, accept_unknown=settings.accept_unknown_fields)
    app[METRICS] = Metrics()
    app[MODELS] = _fleet(settings, pm, app[METRICS], None if models is None else list(models))
    app[TRIMMER] = Trimmer()
    app.on_response_prepare.append(set_request_id_header)
    app.on_response_prepare.append(set_cors_headers)
    app.on_response_prepare.append(set_replica_header)
    app.add_routes(routes)
    app.add_routes(model_routes)
    app.add_routes(tokenizer_routes)
    app.add_routes(OPENAI_ROOT_ROUTES)
    # the OpenAI API: counted, and behind the API key when keys are set
    api = web.Application(
        middlewares=[count_requests_middleware, api_key_middleware], client_max_size=settings.max_body_size
    )
    api.add_routes(OPENAI_ROUTES)
    api.add_subapp(anthropic_api.PREFIX, anthropic_api.messages_app(settings.max_body_size))
    app[RESPONSE_STORE] = ResponseStore(settings.responses_store_size)
    app.add_subapp("/v1", api)
    app.add_subapp(ollama_api.PREFIX, ollama_api.ollama_app(settings.max_body_size))
    app.cleanup_ctx.append(_model_lifecycle)
    app.on_cleanup.append(_close_trimmer)
    return app


async def _close_trimmer(app: web.Application) -> None:
    app[TRIMMER].close()


def _fleet(settings: Settings, pm: pluggy.PluginManager, metrics: Metrics, given: list[Model] | None) -> ModelFleet:
    options = dict(
        max_models=settings.max_models,
        memory_budget=None if settings.models_memory is None else settings.models_memory << 20,
        load_wait=settings.load_wait,
        drain_grace=settings.shutdown_grace,
        retry_after=settings.engine_options().retry_after,
        on_ready=lambda model: metrics.observe_engine(model.engine),
        on_unloaded=lambda model: metrics.forget_engine(model.engine),
    )
    if given is not None:
        return ModelFleet.of_loaded(given, **options)

    def load(plan: ModelPlan, progress, reserve) -> Model:
        return load_served_model(pm, plan.settings, progress=progress, reserve=reserve)

    return ModelFleet(model_plans(settings, pm, settings_table(pm)), load, **options)


async def _model_lifecycle(app: web.Application):
    """The models: loaded (those loaded at start-up) before the server
    takes requests, unloaded at cleanup (handlers had aiohttp's shutdown
    timeout to finish; what is left fails with 503)."""
    fleet = app[MODELS]
    await fleet.start()
    for model in fleet.ready_models():
        log.info("serving", model=model.name, context_length=model.context_length)
    if len(list(fleet)) > 1:
        log.info("models", names=[slot.name for slot in fleet])
    try:
        yield
    finally:
        await fleet.close()


def serving_process(pm: pluggy.PluginManager | None = None) -> pluggy.PluginManager:
    """What a process started to serve does before it loads a model: every
    plugin's `lockgate_serving_process` (the TVM plugin's: its runtime
    library without the compiler). Returns the plugin manager (`pm`, or the
    one `create_app` would build)."""
    pm = pm or get_plugin_manager()
    pm.hook.lockgate_serving_process()
    return pm


def app_from_env() -> web.Application:
    """Logging and settings from the environment (for gunicorn)."""
    pm = serving_process()
    settings = Settings.from_env(table=settings_table(pm))
    configure_logging(settings.log_format, settings.log_level)
    return create_app(settings, pm=pm)


def init_app(argv: list[str] | None = None) -> web.Application:
    """Entry for `python -m aiohttp.web ... lockgate.server.app:init_app [flags]`:
    extra flags are those of `lockgate serve` (host and port belong to aiohttp)."""
    pm = serving_process()
    args = serve_parser(pm=pm).parse_args(argv or [])
    settings = settings_from_args(args, pm)
    configure_logging(settings.log_format, settings.log_level)
    return create_app(settings, pm=pm)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `lockgate serve` instead")
