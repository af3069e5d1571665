"""Several models in one server, each in a child process of its own, through
HTTP: served at once and swapped under a one-model limit, one load for
twenty first requests, a TTL unload whose child is gone, a crashed child
that leaves the other model serving, the memory budget, the lifecycle
routes and Ollama's `keep_alive`. The fleet's rules alone, on stub
loaders, are tests/unit/models/test_fleet.py's."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

import slow_executor
from helpers import TINY_EXECUTOR, wait_for
from tiny_model import write_tiny_gguf

from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.server.app import create_app
from lockgate.server.config import Settings

pytestmark = pytest.mark.tvm

PROMPT = dict(prompt="lamp table", max_tokens=6, temperature=0, logprobs=1, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def two_files(tmp_path_factory, tiny_gguf):
    """The shared tiny file (a) and one of other weights (b)."""
    other = write_tiny_gguf(tmp_path_factory.mktemp("fleet") / "tiny-b.gguf", seed=1)
    return {"a": tiny_gguf, "b": other}


@pytest.fixture
def serve(aiohttp_client, two_files):
    """`await serve(**settings)`: a live server of models a and b (each in
    its own process); returns (the aiohttp test client, an openai client,
    which the test closes)."""

    async def make(plugins=(), **settings):
        models = tuple(f"{name}={path}" for name, path in two_files.items())
        app = create_app(Settings(model=models, **{**TINY_EXECUTOR, **settings}),
                         pm=get_plugin_manager(autoload=False, plugins=plugins))
        client = await aiohttp_client(app)
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0, timeout=120)
        return client, sdk

    return make


async def complete(sdk, model: str) -> tuple[str, tuple[float, ...]]:
    """A greedy answer: its text and its tokens' logprobs (two random tiny
    models may agree on the text, never on the logprobs)."""
    reply = await sdk.completions.create(model=model, **PROMPT)
    assert reply.model == model
    choice = reply.choices[0]
    return choice.text, tuple(round(p, 4) for p in choice.logprobs.token_logprobs)


async def states(client) -> dict[str, dict]:
    listed = await (await client.get("/v1/models")).json()
    return {card["id"]: card["status"] for card in listed["data"]}


async def pid_of(client, name: str) -> int:
    health = await (await client.get("/health")).json()
    return health["models"][name]["pid"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_files_served_at_once_then_swapped_under_a_one_model_limit(serve, tiny_model, make_openai):
    client, sdk = await serve()
    assert {name: s["value"] for name, s in (await states(client)).items()} == {"a": "unloaded", "b": "unloaded"}
    a, b = await complete(sdk, "a"), await complete(sdk, "b")
    assert a != b  # two models, two answers
    # the child's engine answers as the engine in this process does on the same file
    local = await make_openai(tiny_model)
    assert await complete(local, "tiny") == a
    both = await states(client)
    assert both["a"]["value"] == both["b"]["value"] == "ready"
    pid_a, pid_b = await pid_of(client, "a"), await pid_of(client, "b")
    assert pid_a != pid_b and os.getpid() not in (pid_a, pid_b)

    one, one_sdk = await serve(max_models=1)
    assert await complete(one_sdk, "a") == a
    assert await complete(one_sdk, "b") == b  # a is unloaded to make room
    swapped = await states(one)
    assert (swapped["a"]["value"], swapped["b"]["value"]) == ("unloaded", "ready")
    assert await complete(one_sdk, "a") == a
    assert (await states(one))["a"]["loads"] == 2
    await sdk.close()
    await one_sdk.close()


async def test_twenty_first_requests_start_one_load(serve):
    client, sdk = await serve()
    answers = await asyncio.gather(*(complete(sdk, "a") for _ in range(20)))
    assert len(set(answers)) == 1
    assert (await states(client))["a"]["loads"] == 1
    await sdk.close()


async def test_an_idle_model_unloads_after_its_ttl_and_its_process_ends(serve):
    client, sdk = await serve(idle_ttl=1.0)
    await complete(sdk, "a")
    pid = await pid_of(client, "a")
    assert alive(pid)

    async def unloaded():
        return (await states(client))["a"]["value"] == "unloaded"

    await wait_for(unloaded, timeout=30, what="the TTL unload")
    await wait_for(lambda: not alive(pid), timeout=30, what="the model's process gone")
    # and the next request loads it again, in a new process
    await complete(sdk, "a")
    assert await pid_of(client, "a") != pid
    await sdk.close()


async def test_a_crashed_model_process_leaves_the_other_model_serving(serve):
    # the slow executor (a plugin module the children load too): 500 tokens take 5 s or more
    client, sdk = await serve(plugins=[slow_executor], executor="slow")
    await complete(sdk, "a")
    await complete(sdk, "b")
    pid_a = await pid_of(client, "a")
    stream = await sdk.completions.create(model="a", prompt="lamp", max_tokens=500, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    await stream.__anext__()
    os.kill(pid_a, signal.SIGKILL)
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert "stopped serving" in str(caught.value)
    assert await complete(sdk, "b")  # the other model and the front go on

    async def unloaded():
        return (await states(client))["a"]["value"] == "unloaded"

    await wait_for(unloaded, timeout=30, what="the dead model unloaded")
    assert "exit code -9" in (await states(client))["a"]["error"]
    await complete(sdk, "a")  # loaded again
    assert await pid_of(client, "a") != pid_a
    await sdk.close()


async def test_the_memory_budget_swaps_models_and_a_model_past_it_is_a_503(serve):
    # a tiny model reserves 1.4 MiB (weights and a 1 MiB KV cache): two do not fit in 2
    client, sdk = await serve(models_memory=2)
    a = await complete(sdk, "a")
    await complete(sdk, "b")
    assert {n: s["value"] for n, s in (await states(client)).items()} == {"a": "unloaded", "b": "ready"}
    assert (await states(client))["b"]["memory"] == {"weights": 372736, "kv_cache": 1 << 20}
    assert await complete(sdk, "a") == a
    await sdk.close()

    client, sdk = await serve(models_memory=1)
    with pytest.raises(openai.InternalServerError) as refused:
        await complete(sdk, "a")
    assert refused.value.status_code == 503
    assert "more than the whole memory budget of 1.0 MiB" in refused.value.message
    await sdk.close()


async def test_the_lifecycle_routes(serve):
    client, sdk = await serve()
    loaded = await client.post("/models/load", json={"model": "b"})
    assert loaded.status == 200
    body = await loaded.json()
    assert body["success"] and body["id"] == "b" and body["status"]["value"] == "ready"
    pid = await pid_of(client, "b")
    unloaded = await client.post("/models/unload", json={"model": "b"})
    assert (await unloaded.json())["status"]["value"] == "unloaded"
    await wait_for(lambda: not alive(pid), timeout=30, what="the unloaded model's process gone")
    unknown = await client.post("/models/load", json={"model": "c"})
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"
    extra = await client.post("/models/load", json={"model": "b", "force": True})
    assert extra.status == 400 and (await extra.json())["error"]["param"] == "force"
    await sdk.close()


async def test_ollama_keep_alive_and_ps(serve):
    client, sdk = await serve()
    loaded = await client.post("/api/generate", json={"model": "a"})
    assert (await loaded.json())["done_reason"] == "load"
    ps = await (await client.get("/api/ps")).json()
    assert [m["name"] for m in ps["models"]] == ["a:latest"]
    tags = await (await client.get("/api/tags")).json()
    assert {m["name"] for m in tags["models"]} == {"a:latest", "b:latest"}
    assert {m["details"]["family"] for m in tags["models"]} == {"llama"}  # b read from its file, unloaded
    gone = await client.post("/api/generate", json={"model": "a", "keep_alive": 0})
    assert (await gone.json())["done_reason"] == "unload"

    async def unloaded():
        return (await states(client))["a"]["value"] == "unloaded"

    await wait_for(unloaded, timeout=30, what="keep_alive 0's unload")
    bad = await client.post("/api/chat", json={"model": "a", "keep_alive": "soon",
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status == 400 and "keep_alive" in (await bad.json())["error"]
    await sdk.close()
