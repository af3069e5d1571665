"""The same answer whatever the cache holds (issue 35): every request is
asked of an engine with the prefix cache and of one without, on each
family's tiny file (float32 and 8-bit activations) and on the default
model, and the tokens and logprobs must be equal, exactly: cold and
repeated, whole and streamed, a conversation continued after its answer
(a prefix holding decoded tokens), prompts longer than a prefill chunk,
requests batched together and `n` > 1."""

from __future__ import annotations

import asyncio
import json

import pytest

from tiny_model import FAMILY_VARIANTS, KQUANT_CONFIG, Q4_K_M, write_tiny_gguf

from lockgate.engine import EngineOptions
from lockgate.engine.executor import ExecutorOptions
from lockgate.models.loading import load_model
from lockgate.plugin_api.manager import get_plugin_manager

#: the files: every family, and the 8-bit path (packed weights multiply
#: activations rounded to 8 bits)
FILES = {
    "llama": {},
    **FAMILY_VARIANTS,
    "llama-q8_0": {"tensor_type": "Q8_0"},
    "llama-q4_k_m": {**KQUANT_CONFIG, "tensor_type": "Q4_K", "tensor_types": Q4_K_M},
}
SYSTEM = "You are a terse assistant. " * 6


def chats(long_text: str):
    """The requests, in the order they are sent: each (name, endpoint, body)."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    return [
        ("cold", "/v1/chat/completions", {"messages": first}),
        ("repeat", "/v1/chat/completions", {"messages": first}),
        ("streamed", "/v1/chat/completions", {"messages": first, "stream": True}),
        ("other question, shared system prompt", "/v1/chat/completions",
         {"messages": [first[0], {"role": "user", "content": "Name a number."}]}),
        ("longer than a chunk", "/v1/completions", {"prompt": long_text}),
        ("longer than a chunk, again", "/v1/completions", {"prompt": long_text}),
        ("n=2, seeded", "/v1/chat/completions", {"messages": first, "n": 2, "temperature": 1.0, "seed": 3}),
    ]


def load(path, *, prefix_cache: bool, **executor):
    return load_model(
        get_plugin_manager(autoload=False), str(path), served_name="m",
        executor_options=ExecutorOptions.of(**{"max_num_seqs": 8, "max_total_tokens": 4096,
                                               "prefill_chunk_size": 32, **executor}),
        engine_options=EngineOptions(prefix_cache=prefix_cache),
    )


async def answer(client, endpoint: str, body: dict, cached: dict | None = None, name: str = "") -> list[dict]:
    """Each choice's tokens and logprobs (with their alternatives); the
    prompt tokens read from the cache go in `cached[name]`."""
    body = {"model": "m", "max_tokens": 10, "temperature": 0, "logprobs": True, "return_token_ids": True,
            "ignore_eos": True, **body}
    if endpoint == "/v1/chat/completions":
        body["top_logprobs"] = 3
    else:
        body["logprobs"] = 3
    response = await client.post(endpoint, json=body)
    assert response.status == 200, await response.text()
    if not body.get("stream"):
        reply = await response.json()
        if cached is not None:
            cached[name] = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return [{"tokens": c["token_ids"], "logprobs": c["logprobs"]} for c in reply["choices"]]
    choices: dict[int, dict] = {}
    for line in (await response.text()).splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"tokens": [], "logprobs": {"content": [], "refusal": None}})
                got["tokens"] += c.get("token_ids") or []
                if c.get("logprobs"):
                    got["logprobs"]["content"] += c["logprobs"]["content"]
    return [choices[i] for i in sorted(choices)]


async def conversation(client, requests, cached: dict) -> dict[str, list[dict]]:
    answers = {}
    for name, endpoint, body in requests:
        answers[name] = await answer(client, endpoint, body, cached, name)
    # the conversation goes on after its first answer: a prefix that holds decoded tokens
    first = requests[0][2]["messages"]
    said = answers["cold"][0]["logprobs"]["content"]
    reply = "".join(entry["token"] for entry in said)
    follow_up = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Another."}]
    answers["continued"] = await answer(client, "/v1/chat/completions", {"messages": follow_up}, cached, "continued")
    # four at once: batched prefill and decode
    batch = [("batched " + name, endpoint, body) for name, endpoint, body in requests[:4] if "stream" not in body]
    results = await asyncio.gather(*(answer(client, endpoint, body) for _, endpoint, body in batch))
    answers.update({name: result for (name, _, _), result in zip(batch, results)})
    return answers


def assert_same(cached: dict, uncached: dict) -> None:
    assert cached.keys() == uncached.keys()
    for name in cached:
        assert cached[name] == uncached[name], f"{name}: the cached engine answered otherwise"
    # and within one engine: a repeat, a stream and a batch answer as the first did
    for name in ("repeat", "streamed", "batched cold", "batched repeat"):
        assert cached[name] == cached["cold"], name


@pytest.mark.parametrize("name", sorted(FILES))
async def test_every_family_answers_the_same_with_and_without_the_cache(name, tmp_path_factory, make_client):
    overrides = dict(FILES[name])
    path = write_tiny_gguf(tmp_path_factory.mktemp("files") / f"{name}.gguf", seed=21,
                           tensor_type=overrides.pop("tensor_type", "F32"),
                           tensor_types=overrides.pop("tensor_types", None), **overrides)
    await assert_same_with_and_without_the_cache(path, make_client, " ".join(f"w{i}" for i in range(60)))


async def assert_same_with_and_without_the_cache(path, make_client, long_text, **executor):
    """The conversation on an engine with the prefix cache, then on one
    without (each app closed, its engine stopped, after), and the two
    answered alike."""
    models = [load(path, prefix_cache=cache, **executor) for cache in (True, False)]
    answers, cached = [], [{}, {}]
    try:
        for model, reads in zip(models, cached):
            client = await make_client(model)
            try:
                answers.append(await conversation(client, chats(long_text), reads))
                assert model.engine.stats().kv_pages_used == 0
            finally:
                await client.close()
    finally:
        for model in models:
            model.close()
    # the cached engine did read these prompts' prefixes from its cache
    for name in ("repeat", "other question, shared system prompt", "longer than a chunk, again", "continued"):
        assert cached[0][name] > 0 and cached[1][name] == 0, (name, cached)
    assert_same(*answers)


@pytest.mark.default_model
@pytest.mark.parametrize("exact", [False, True], ids=["8-bit activations", "exact matmul"])
async def test_the_default_model_answers_the_same_with_and_without_the_cache(exact, make_client):
    long_text = "The history of the lighthouse begins with fires lit on hills. " * 8
    await assert_same_with_and_without_the_cache("SmolLM2-135M-Instruct", make_client, long_text,
                                                 exact_matmul=exact, prefill_chunk_size=64)
