"""The server's own routes, outside the API: `/health` (open to all) and
`/metrics` (behind the API key unless `--metrics-public`). The API's are in
`lockgate.server.openai_api`, the tokenizer's in
`lockgate.server.tokenizer_routes`.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lockgate.errors import Unavailable
from lockgate.models.slots import READY
from lockgate.server.keys import METRICS, MODELS, SETTINGS
from lockgate.server.middlewares import require_api_key

routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Open to all, API keys or not: load balancers and orchestrators probe
    it. Each model's state, and a loaded one's engine figures; 503 while a
    loaded model's engine cannot serve (a model not loaded is no fault:
    the next request for it loads it)."""
    fleet = request.app[MODELS]
    models = {}
    for slot in fleet:
        entry = slot.describe()
        if slot.state == READY and slot.loaded is not None:
            engine = slot.loaded.model.engine
            if not engine.healthy:
                raise Unavailable(f"model {slot.name} is not serving: "
                                  + (engine.unhealthy_reason or "the server is shutting down"))
            entry.update(engine.stats().as_dict())
        models[slot.name] = entry
    return web.json_response({"status": "ok", "models": models})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Behind the API key like the API (the figures tell load and traffic),
    unless `--metrics-public` opens it to a scraper that sends no key."""
    if not request.app[SETTINGS].metrics_public:
        require_api_key(request)
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
