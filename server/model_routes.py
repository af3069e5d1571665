"""The models' lifecycle at the root, as llama.cpp's router serves it:
`POST /models/load` and `POST /models/unload` with `{"model": NAME}`
(behind the API key). A load waits for the model to be ready (or answers
503 with Retry-After, as a request for it would); an unload lets the
model's running requests finish (up to the shutdown grace), then stops its
engine, and in a model's own process gives its memory back. Each answers
the model's card (`/v1/models`)."""

from __future__ import annotations

from aiohttp import web

from lockgate.errors import UnknownParameter
from lockgate.server.keys import MODELS
from lockgate.server.middlewares import require_api_key
from lockgate.server.openai_api.models import model_card
from lockgate.server.protocol import read_json_body

model_routes = web.RouteTableDef()


async def _named(request: web.Request):
    """The body's `model` (checked by the fleet's lookup: 400 missing or
    not a string, 404 unknown); any other field is a 400."""
    require_api_key(request)
    body = await read_json_body(request)
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise UnknownParameter(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    return body.get("model")


@model_routes.post("/models/load")
async def load(request: web.Request) -> web.Response:
    slot = await request.config_dict[MODELS].load(await _named(request))
    return web.json_response({"success": True, **model_card(slot)})


@model_routes.post("/models/unload")
async def unload(request: web.Request) -> web.Response:
    slot = await request.config_dict[MODELS].unload(await _named(request))
    return web.json_response({"success": True, **model_card(slot)})
