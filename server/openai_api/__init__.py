"""The OpenAI API under `/v1`: one module per endpoint, each with its own
response builder, over the serving skeleton (`lockgate.server.serving`):

* `chat`: `POST /v1/chat/completions`;
* `completions`: `POST /v1/completions` (`echo`, several prompts);
* `choices`: what those two share (a response of choices, whole or as
  chunks; the loops that read deltas into them);
* `responses`: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}` and
  the response store;
* `embeddings`: `POST /v1/embeddings`;
* `rerank`: `POST /v1/rerank` and `POST /v1/score` (and both at the root);
* `models`: `GET /v1/models`, `GET /v1/models/{id}`.

Bodies are typed by `lockgate.plugin_api.request` (and `.responses`) before
any hook runs; these modules only speak the API's shapes.
"""

from __future__ import annotations

from lockgate.server.openai_api import chat, completions, embeddings, models, rerank, responses

#: every route of the API, relative to `/v1`
ROUTES = [*chat.routes, *completions.routes, *responses.routes, *embeddings.routes, *rerank.routes, *models.routes]
#: the routes also served at the root, as vLLM serves them
ROOT_ROUTES = [*rerank.root_routes]
