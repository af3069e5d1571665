"""`POST /v1/rerank` (and `/rerank` at the root, as vLLM and llama.cpp's
server serve it) in Jina's and Cohere's shape, and vLLM's `POST /v1/score`
(and `/score`): each (query, document) pair's relevance from the model's
classification head (`lockgate.plugin_api.rerank`), on the same pooled path
as embeddings."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from lockgate.errors import InvalidRequestError
from lockgate.models import Model
from lockgate.plugin_api.embeddings import EmbeddingPrompts
from lockgate.plugin_api.fields import RERANK, SCORE
from lockgate.plugin_api.pipeline import in_worker
from lockgate.plugin_api.rerank import pair_token_ids, parse_rank_request
from lockgate.engine.pooling import LAST
from lockgate.server.keys import FIELD_POLICY, REQUEST_ID
from lockgate.server.middlewares import require_api_key
from lockgate.server.protocol import leased_model, read_json_body
from lockgate.server.serving import pooled

#: under /v1
routes = web.RouteTableDef()
#: at the root
root_routes = web.RouteTableDef()


async def _scores(request: web.Request, endpoint: str):
    require_api_key(request)
    body = await read_json_body(request)
    model: Model = await leased_model(request, body.get("model"))
    typed = parse_rank_request(endpoint, body, request_id=request[REQUEST_ID],
                               fields=request.config_dict[FIELD_POLICY])
    if model.rank_head is None:
        raise InvalidRequestError(
            f"the model {model.name} is not a reranker: its file carries no classification head "
            "(cls.output.weight)", param="model")
    pairs = typed.pairs()
    prompts = await in_worker(lambda: tuple(
        tuple(pair_token_ids(model.tokenizer, model.rerank_template, query, document)) for query, document in pairs))
    asked = EmbeddingPrompts.checked(id=typed.id, body=body, model=typed.model, prompts=prompts, max_tokens=0)
    vectors, usage = await pooled(request, asked, model, LAST)
    return typed, model, [model.rank_head.score(v) for v in vectors], usage


@routes.post("/rerank")
@root_routes.post("/rerank")
async def rerank(request: web.Request) -> web.Response:
    typed, model, scores, usage = await _scores(request, RERANK)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: typed.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if typed.return_documents:
            result["document"] = {"text": typed.documents[i]}
        results.append(result)
    return web.json_response({"id": f"rerank-{typed.id}", "model": model.name, "object": "list",
                              "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
                              "results": results})


@routes.post("/score")
@root_routes.post("/score")
async def score(request: web.Request) -> web.Response:
    typed, model, scores, usage = await _scores(request, SCORE)
    return web.json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    })
