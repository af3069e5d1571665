"""`POST /v1/embeddings`: one vector per input, in the `list` of
`embedding` objects OpenAI answers with, as floats or base64."""

from __future__ import annotations

from aiohttp import web

from lockgate.plugin_api.embeddings import encoded, parse_embedding_request
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.protocol import leased_model, read_json_body
from lockgate.server.serving import embed

routes = web.RouteTableDef()


@routes.post("/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body = await read_json_body(request)
    model = await leased_model(request, body.get("model"))
    typed = parse_embedding_request(body, request_id=request[REQUEST_ID], fields=request.config_dict[FIELD_POLICY])
    vectors, usage = await embed(request, typed, model)
    return web.json_response({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v, typed.encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model.name,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    })
