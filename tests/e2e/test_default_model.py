"""The default model end to end: the whole engine path reproduces llama.cpp's
greedy tokens, and the openai SDK gets sensible answers."""

from __future__ import annotations

import asyncio

import pytest

from helpers import wait_idle
from golden import GREEDY_IDS, PROMPT_IDS

pytestmark = pytest.mark.default_model


@pytest.mark.parametrize("fixture", ["default_model_int8", "default_model"])
async def test_engine_path_reproduces_llama_cpp_greedy(fixture, request, make_openai):
    """As served by default (8-bit activations, as llama.cpp's) and exact."""
    model = request.getfixturevalue(fixture)
    client = await make_openai(model)
    reply = await client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT_IDS, max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    expected = model.tokenizer.decode(GREEDY_IDS, skip_special_tokens=False)
    assert reply.choices[0].text == expected
    assert reply.usage.completion_tokens == 30
    # with end of turn as a stop, the answer ends at <|im_end|>
    answer = await client.completions.create(
        model="smollm2", prompt=PROMPT_IDS, max_tokens=30, temperature=0
    )
    assert answer.choices[0].text == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == GREEDY_IDS.index(2) + 1


async def test_chat_through_the_sdk(default_model, make_openai):
    client = await make_openai(default_model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40, temperature=0
    )
    assert "Paris" in whole.choices[0].message.content
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40, temperature=0, stream=True
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert streamed == whole.choices[0].message.content


@pytest.mark.parametrize("fixture", ["default_model_int8", "default_model"])
async def test_concurrent_greedy_equals_alone(fixture, request, make_openai):
    """Batching changes no row's result, with 8-bit activations too: each
    row is rounded and multiplied alone."""
    model = request.getfixturevalue(fixture)
    client = await make_openai(model)
    questions = ["Name a fruit.", "What is 2+2?", "Say hello.", "What color is the sky?"]

    async def ask(question):
        reply = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
            max_tokens=24, temperature=0,
        )
        return reply.choices[0].message.content

    # cold, alone, then cached and batched: neither may change anything
    alone = [await ask(q) for q in questions]
    together = await asyncio.gather(*(ask(q) for q in questions))
    assert list(together) == alone
    assert (await wait_idle(model.engine)).kv_pages_used == 0


def _chat_from_stream(chunks) -> dict:
    """A streamed chat answer put back together in the non-streamed shape."""
    text, logprobs, finish_reason, usage, held_back = "", [], None, None, 0
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            logprobs += [entry.model_dump() for entry in choice.logprobs.content]
            held_back += not choice.delta.content
        finish_reason = choice.finish_reason or finish_reason
    return {"text": text, "logprobs": logprobs, "finish_reason": finish_reason, "usage": usage,
            "chunks with logprobs and no text": held_back}


def _completion_from_stream(chunks) -> dict:
    text, finish_reason, usage, held_back = "", None, None, 0
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            for field, values in logprobs.items():
                values += getattr(choice.logprobs, field)
            held_back += not choice.text
        finish_reason = choice.finish_reason or finish_reason
    return {"text": text, "logprobs": logprobs, "finish_reason": finish_reason, "usage": usage,
            "chunks with logprobs and no text": held_back}


def assert_same_logprobs(got, want, where="logprobs"):
    """Equal structure, tokens and bytes; log-probabilities equal within 0.01."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-2), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_logprobs(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_logprobs(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize(
    "endpoint, request_",
    [
        # multi-byte output: tokens that end inside a UTF-8 sequence
        ("completions", dict(prompt="Good morning in Japanese is", max_tokens=16, logprobs=2)),
        ("chat", dict(messages=[{"role": "user", "content": "Translate to Japanese: good morning"}],
                      max_tokens=24, logprobs=True, top_logprobs=2)),
        # text held back while it may be the start of a stop string, then a stop
        ("chat", dict(messages=[{"role": "user", "content": "Reply with only three emoji about the sea."}],
                      max_tokens=24, logprobs=True, stop=["place of endless joy", "beauty"])),
    ],
    ids=["completions-japanese", "chat-japanese", "chat-stop-holdback"],
)
async def test_stream_equals_whole_field_for_field(default_model, make_openai, endpoint, request_):
    """Every token's logprobs reach a streaming client, also those of tokens
    whose text is held back; put together, the stream is the whole answer."""
    client = await make_openai(default_model)
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    kwargs = dict(model="smollm2", temperature=0, **request_)
    whole = (await create(**kwargs)).model_dump()
    stream = await create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    streamed = (_chat_from_stream if endpoint == "chat" else _completion_from_stream)(chunks)
    choice = whole["choices"][0]
    assert streamed["text"] == (choice["message"]["content"] if endpoint == "chat" else choice["text"])
    expected_logprobs = choice["logprobs"]["content"] if endpoint == "chat" else choice["logprobs"]
    # The stream repeats the request, so its prompt comes from the prefix
    # cache: the same tokens, log-probabilities equal to the f16 KV cache's
    # rounding (the prompt's KV is read back from the cache, not computed in
    # one chunk with it).
    assert_same_logprobs(streamed["logprobs"], expected_logprobs)
    assert streamed["finish_reason"] == choice["finish_reason"]
    # the stream repeats the request, so its prompt came from the prefix cache
    details = streamed["usage"].pop("prompt_tokens_details"), whole["usage"].pop("prompt_tokens_details")
    assert details[0]["cached_tokens"] == whole["usage"]["prompt_tokens"] - 1 > details[1]["cached_tokens"]
    assert streamed["usage"] == whole["usage"]
    tokens = expected_logprobs if endpoint == "chat" else expected_logprobs["tokens"]
    assert len(tokens) == whole["usage"]["completion_tokens"] > 0
    # the case this test is for did happen
    assert streamed["chunks with logprobs and no text"] > 0


async def test_the_readme_example_prints_what_the_server_answers(default_model_int8, make_openai):
    """The README's first example, as `lockgate serve` runs it (8-bit
    activations), streamed: its comment is the answer, asked cold and again."""
    from paths import ROOT

    readme = (ROOT / "README.md").read_text()
    example = readme[readme.index("from openai import OpenAI"):]
    printed = example[example.index("\n# ") + 3:example.index("\n```")]
    client = await make_openai(default_model_int8)
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0, stream=True,
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == printed
