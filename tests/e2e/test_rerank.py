"""`POST /rerank`, `/v1/rerank` and `/v1/score` over HTTP against llama.cpp on
the same tiny rerankers: its rank pooling of Qwen3 with a two-label
classification head, with the file's rerank template and without, and the
softmax over two tokens' logits of a relevance-generation reranker
(`--rerank-tokens`; `tests/data/embedding_goldens.json`, recorded by
`tests/data/record_embedding_goldens.py`)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from helpers import TINY_EXECUTOR, wait_idle
from paths import DATA

from lockgate.engine import EngineOptions
from lockgate.engine.executor import ExecutorOptions
from lockgate.models import load_model
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.rerank import pair_token_ids

sys.path.insert(0, str(DATA))
from record_embedding_goldens import RERANK_CASES, RERANK_TOKENS, sha256, write_case  # noqa: E402

GOLDENS = json.loads((DATA / "embedding_goldens.json").read_text())["rerank"]
AUTH = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory):
    d = tmp_path_factory.mktemp("rerankers")
    models = {}
    for name in RERANK_CASES:
        path = write_case(d, name)
        assert sha256(path) == GOLDENS["cases"][name]["sha256"], "the tiny writer changed: record the goldens again"
        models[name] = load_model(get_plugin_manager(autoload=False), str(path), served_name="tiny",
                                  executor_options=ExecutorOptions.of(**TINY_EXECUTOR),
                                  engine_options=EngineOptions(), rerank_tokens=RERANK_TOKENS.get(name, ()))
    yield models
    for model in models.values():
        model.engine.shutdown()
        model.executor.close()


@pytest.mark.parametrize("name", list(RERANK_CASES))
async def test_rerank_scores_equal_llama_cpp_rank_pooling(name, rerankers, make_client):
    model = rerankers[name]
    golden = GOLDENS["cases"][name]
    assert model.rank_head is not None
    # a head's file says rank pooling; a relevance-generation one is named by --rerank-tokens
    assert model.pooling == ("mean" if name in RERANK_TOKENS else "last")
    for document, tokens in zip(GOLDENS["documents"], golden["prompts"]):
        assert pair_token_ids(model.tokenizer, model.rerank_template, GOLDENS["query"], document) == tokens
    client = await make_client(model, api_keys=("k",))
    body = {"model": "tiny", "query": GOLDENS["query"], "documents": GOLDENS["documents"]}
    reply = await client.post("/v1/rerank", json=body, headers=AUTH)
    assert reply.status == 200, await reply.text()
    answer = await reply.json()
    got = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert [r["relevance_score"] for r in answer["results"]] == sorted(got.values(), reverse=True)
    # f16 weights summed in another order: a head output moves by a few
    # thousandths (embeddings agree within cosine 0.9999, test_embeddings)
    for i, want in enumerate(golden["scores"]):
        assert got[i] == pytest.approx(want, abs=1e-3), (i, got[i], want)
        for j, other in enumerate(golden["scores"]):
            if want - other > 2e-3:  # llama.cpp's order, where it is clear
                assert got[i] > got[j]
        assert answer["results"][[r["index"] for r in answer["results"]].index(i)]["document"] == {
            "text": GOLDENS["documents"][i]}
    assert answer["usage"]["total_tokens"] == sum(map(len, golden["prompts"]))
    # the root route, top_n, documents as objects, no documents back
    root = await client.post("/rerank", headers=AUTH, json={
        **body, "documents": [{"text": d} for d in GOLDENS["documents"]], "top_n": 2, "return_documents": False})
    best = (await root.json())["results"]
    assert [r["index"] for r in best] == [r["index"] for r in answer["results"][:2]]
    assert all("document" not in r for r in best)
    # vLLM's score: one text against many, and pair by pair
    scored = await client.post("/v1/score", headers=AUTH, json={
        "model": "tiny", "text_1": GOLDENS["query"], "text_2": GOLDENS["documents"]})
    data = (await scored.json())["data"]
    assert [d["score"] for d in data] == pytest.approx([got[i] for i in range(len(got))], abs=1e-6)
    paired = await client.post("/score", headers=AUTH, json={
        "model": "tiny", "text_1": [GOLDENS["query"]] * 2, "text_2": GOLDENS["documents"][:2]})
    assert [d["score"] for d in (await paired.json())["data"]] == pytest.approx([got[0], got[1]], abs=1e-6)
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_the_query_is_computed_once_through_the_prefix_cache(rerankers, make_client):
    """With the rerank template the pairs share a long prefix: the cache
    holds it after the first pair, and the scores are the same as without."""
    model = rerankers["qwen3-rerank-template"]
    client = await make_client(model, api_keys=("k",))
    documents = [f"document number {i} about cats" for i in range(6)]
    first = await client.post("/v1/score", headers=AUTH, json={"model": "tiny", "text_1": GOLDENS["query"],
                                                                 "text_2": documents})
    again = await client.post("/v1/score", headers=AUTH, json={"model": "tiny", "text_1": GOLDENS["query"],
                                                                 "text_2": documents[::-1]})
    one = [d["score"] for d in (await first.json())["data"]]
    other = [d["score"] for d in (await again.json())["data"]][::-1]
    assert one == pytest.approx(other, abs=1e-5)
    assert model.engine.stats().prefix_cache_sequences > 0


@pytest.mark.parametrize("route, body, param", [
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [3]}, "documents[0]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "temperature": 1}, "temperature"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
])
async def test_bad_rerank_bodies_are_400s_naming_the_field(route, body, param, rerankers, make_client):
    client = await make_client(rerankers["qwen3-rerank-plain"], api_keys=("k",))
    reply = await client.post(route, headers=AUTH, json={"model": "tiny", **body})
    assert reply.status == 400
    assert (await reply.json())["error"]["param"] == param


async def test_a_model_without_a_head_is_not_a_reranker(tiny_model, make_client):
    client = await make_client(tiny_model)
    reply = await client.post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["a"]})
    assert reply.status == 400
    error = (await reply.json())["error"]
    assert error["param"] == "model" and "classification head" in error["message"]
