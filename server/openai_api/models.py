"""`GET /v1/models` and `GET /v1/models/{id}`: every model the server is
configured to serve, loaded or not, with its state (`status.value`:
unloaded, loading, ready or draining, as llama.cpp's router reports it in
`status`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lockgate.models.slots import ModelSlot
from lockgate.server.keys import MODELS

routes = web.RouteTableDef()


def model_card(slot: ModelSlot) -> dict[str, Any]:
    """A model's entry in `GET /v1/models`: its context length where it is
    loaded, its state, memory and running requests."""
    card: dict[str, Any] = {"id": slot.name, "object": "model", "created": slot.created, "owned_by": "lockgate"}
    if slot.loaded is not None:
        card["max_model_len"] = slot.loaded.model.context_length
    if slot.plan.aliases:
        card["aliases"] = list(slot.plan.aliases)
    described = slot.describe()
    card["status"] = {"value": described.pop("state"), **described}
    return card


@routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(s) for s in request.config_dict[MODELS]]})


@routes.get("/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    return web.json_response(model_card(request.config_dict[MODELS].slot(request.match_info["model"])))
