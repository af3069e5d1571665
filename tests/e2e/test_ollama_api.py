"""Ollama's API through the `ollama` Python client, unmodified, against a
live server on loopback: list, show, ps, chat (whole and streamed),
generate, `format`, a tool round trip, and errors in Ollama's shape. The
same greedy request answers the same text here as on /v1/chat/completions."""

from __future__ import annotations

import json

import ollama
import openai
import pytest


@pytest.fixture
async def make_ollama(make_client):
    """`await make_ollama(model, **settings)`: an `ollama.AsyncClient` and
    the aiohttp test client of the same live server."""
    clients = []

    async def make(model, *, headers=None, **settings):
        client = await make_client(model, **settings)
        sdk = ollama.AsyncClient(host=str(client.make_url("")).rstrip("/"), headers=headers or {})
        clients.append(sdk)
        return sdk, client

    yield make
    for sdk in clients:
        await sdk.close()


GREEDY = {"temperature": 0, "num_predict": 6}
USER = [{"role": "user", "content": "the cat sat on the mat"}]


async def test_list_show_ps_and_version_describe_the_served_model(tiny_model, make_ollama):
    sdk, client = await make_ollama(tiny_model)
    listed = await sdk.list()
    [entry] = listed.models
    assert entry.model == "tiny:latest" and entry.size > 0 and len(entry.digest) == 64
    assert entry.details.format == "gguf" and entry.details.family == tiny_model.config.architecture
    assert entry.details.parameter_size.endswith("M")
    shown = await sdk.show("tiny")
    assert shown.modelinfo["general.architecture"] == tiny_model.config.architecture
    assert shown.modelinfo[f"{tiny_model.config.architecture}.context_length"] == tiny_model.context_length
    assert shown.modelinfo["general.parameter_count"] > 0
    assert "completion" in shown.capabilities and shown.template
    assert (await sdk.show("tiny:latest")).modelinfo == shown.modelinfo
    running = await sdk.ps()
    assert [m.model for m in running.models] == ["tiny:latest"]
    version = await client.get("/api/version")
    assert (await version.json())["version"].count(".") == 2


async def test_chat_whole_and_streamed_is_the_openai_answer(tiny_model, make_ollama):
    sdk, client = await make_ollama(tiny_model)
    whole = await sdk.chat(model="tiny", messages=USER, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and 0 < whole.eval_count <= 6
    assert whole.message.role == "assistant" and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration >= 0
    parts = [part async for part in await sdk.chat(model="tiny", messages=USER, options=GREEDY, stream=True)]
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0) as sdk_v1:
        reply = await sdk_v1.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=6)
    assert reply.choices[0].message.content == whole.message.content
    assert reply.usage.completion_tokens == whole.eval_count
    assert reply.usage.prompt_tokens == whole.prompt_eval_count


async def test_generate_is_a_chat_of_one_turn(tiny_model, make_ollama):
    sdk, client = await make_ollama(tiny_model)
    generated = await sdk.generate(model="tiny", prompt=USER[0]["content"], options=GREEDY)
    chatted = await sdk.chat(model="tiny", messages=USER, options=GREEDY)
    assert generated.response == chatted.message.content and generated.done
    streamed = [p async for p in await sdk.generate(model="tiny", prompt=USER[0]["content"], options=GREEDY,
                                                        stream=True)]
    assert "".join(p.response for p in streamed) == generated.response
    loaded = await sdk.generate(model="tiny", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_format_holds_the_answer_to_its_schema(tiny_model, make_ollama):
    sdk, _ = await make_ollama(tiny_model)
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]}
    reply = await sdk.chat(model="tiny", messages=USER, format=schema, options={"temperature": 0.7, "seed": 3})
    assert json.loads(reply.message.content)["pet"] in ("cat", "dog")
    reply = await sdk.generate(model="tiny", prompt="hi", format="json", options={"num_predict": 40})
    assert reply.response.lstrip().startswith("{")


async def test_a_tool_round_trip_reads_ollamas_calls(default_model, make_ollama):
    """An assistant turn's calls (no ids: Ollama has none) and the tool's
    answer by `tool_name` are read as chat's; the model answers after them."""
    sdk, _ = await make_ollama(default_model)
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "18 C and sunny"}]
    reply = await sdk.chat(model=default_model.name, messages=messages, tools=[weather],
                           options={"temperature": 0, "num_predict": 30})
    assert reply.done and (reply.message.content or reply.message.tool_calls)
    for call in reply.message.tool_calls or ():
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


async def test_errors_are_ollamas_and_the_client_raises_them(tiny_model, make_ollama):
    sdk, client = await make_ollama(tiny_model)
    cases = [
        (dict(model="tiny", messages=USER, options={"mirostat": 2}), 400, "options.mirostat"),
        (dict(model="tiny", messages=USER, options={"warp": 1}), 400, "options.warp"),
        (dict(model="tiny", messages=USER, options={"num_ctx": 10 ** 7}), 400, "num_ctx"),
        (dict(model="tiny", messages=USER, think=True), 400, "think"),
        (dict(model="nope", messages=USER), 404, "nope"),
        (dict(model="tiny", messages=[{"role": "tool", "content": "x"}]), 400, "answers no earlier tool call"),
    ]
    for kwargs, status, says in cases:
        with pytest.raises(ollama.ResponseError) as raised:
            await sdk.chat(**kwargs, stream=False)
        assert raised.value.status_code == status and says in raised.value.error, (kwargs, raised.value.error)
    response = await client.post("/api/nope", json={})
    assert response.status == 404 and set(await response.json()) == {"error"}
    response = await client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "raw": True})
    assert response.status == 400 and "raw" in (await response.json())["error"]


async def test_the_api_key_guards_ollamas_routes_too(tiny_model, make_ollama):
    sdk, client = await make_ollama(tiny_model, api_keys=("k",))
    with pytest.raises(ollama.ResponseError) as raised:
        await sdk.list()
    assert raised.value.status_code == 401
    keyed = ollama.AsyncClient(host=str(client.make_url("")).rstrip("/"), headers={"Authorization": "Bearer k"})
    try:
        assert (await keyed.list()).models
    finally:
        await keyed.close()


async def test_embed_is_the_openai_embedding(tiny_model, make_ollama):
    """`embed` through the client: one unit vector per input, the same as
    /v1/embeddings gives; an input past the context is cut to it (Ollama's
    `truncate`, on by default) or, with `truncate` false, a 400; `num_ctx`
    cuts sooner."""
    sdk, client = await make_ollama(tiny_model)
    assert "embedding" in (await sdk.show("tiny")).capabilities
    reply = await sdk.embed(model="tiny", input=["the cat sat", "on the mat"])
    assert len(reply.embeddings) == 2 and reply.prompt_eval_count > 0
    same = await client.post("/v1/embeddings", json={"model": "tiny", "input": "the cat sat"},
                             headers={"Authorization": "Bearer x"})
    assert reply.embeddings[0] == pytest.approx((await same.json())["data"][0]["embedding"], abs=1e-6)
    long = "the cat sat on the mat " * 200
    cut = await sdk.embed(model="tiny", input=long)
    assert cut.prompt_eval_count == tiny_model.context_length
    shorter = await sdk.embed(model="tiny", input=long, options={"num_ctx": 32})
    assert shorter.prompt_eval_count == 32
    with pytest.raises(ollama.ResponseError) as caught:
        await sdk.embed(model="tiny", input=long, truncate=False)
    assert caught.value.status_code == 400 and "input" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        await sdk.embed(model="tiny", input="hi", dimensions=3)
    assert caught.value.status_code == 400 and "dimensions" in caught.value.error
