"""The default model end to end: the whole engine path reproduces llama.cpp's
greedy tokens, and the openai SDK gets sensible answers."""

from __future__ import annotations

import asyncio

import pytest

from conftest import wait_idle
from golden import GREEDY_IDS, PROMPT_IDS

pytestmark = pytest.mark.default_model


async def test_engine_path_reproduces_llama_cpp_greedy(default_model, make_openai):
    client = await make_openai(default_model)
    reply = await client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT_IDS, max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    expected = default_model.tokenizer.decode(GREEDY_IDS, skip_special_tokens=False)
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


async def test_concurrent_greedy_equals_alone(default_model, make_openai):
    client = await make_openai(default_model)
    questions = ["Name a fruit.", "What is 2+2?", "Say hello.", "What color is the sky?"]

    async def ask(question):
        reply = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
            max_tokens=24, temperature=0,
        )
        return reply.choices[0].message.content

    alone = [await ask(q) for q in questions]
    together = await asyncio.gather(*(ask(q) for q in questions))
    assert list(together) == alone
    assert (await wait_idle(default_model.engine))["kv_pages_used"] == 0
