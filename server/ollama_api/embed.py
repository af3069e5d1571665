"""`POST /api/embed` in Ollama's shape: `{"model", "embeddings": [[...], ...],
"total_duration", "load_duration", "prompt_eval_count"}`, on the same
embeddings path as `/v1/embeddings` (`serving.embed`)."""

from __future__ import annotations

import time

from aiohttp import web

from lockgate.plugin_api.ollama import parse_ollama_embed, read_keep_alive
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.ollama_api.models import model_name, ollama_name
from lockgate.server.protocol import keep_alive, leased_model, read_json_body
from lockgate.server.serving import embed

routes = web.RouteTableDef()


@routes.post("/embed")
async def embed_route(request: web.Request) -> web.Response:
    started = time.monotonic_ns()
    body = await read_json_body(request)
    model = await leased_model(request, model_name(body.get("model")))
    typed = parse_ollama_embed(body, request_id=request[REQUEST_ID], fields=request.config_dict[FIELD_POLICY])
    keep_alive(request, read_keep_alive(body.get("keep_alive"), "keep_alive"))
    vectors, usage = await embed(request, typed, model)
    return web.json_response({
        "model": ollama_name(model),
        "embeddings": [[float(x) for x in vector] for vector in vectors],
        "total_duration": time.monotonic_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
    })
