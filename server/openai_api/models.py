"""`GET /v1/models` and `GET /v1/models/{id}`: the served models' cards."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lockgate.errors import ModelNotFound
from lockgate.models import Model
from lockgate.server.keys import MODELS

routes = web.RouteTableDef()


def model_card(model: Model) -> dict[str, Any]:
    """The model's entry in `GET /v1/models`."""
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "lockgate",
        "max_model_len": model.context_length,
    }


@routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(m) for m in request.config_dict[MODELS]]})


@routes.get("/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for model in request.config_dict[MODELS]:
        if name == model.name or name in model.aliases:
            return web.json_response(model_card(model))
    raise ModelNotFound(f"The model '{name}' does not exist", param="model")
