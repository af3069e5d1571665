"""End to end through the real openai SDK against a live server on loopback."""

from __future__ import annotations

import math

import openai
import pytest

from helpers import ALTERNATING_TEMPLATE, wait_idle

USER = [{"role": "user", "content": "the cat sat on the mat"}]


async def test_chat_non_stream(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    reply = await client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion"
    assert reply.model == "tiny"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


async def test_chat_stream_equals_non_stream(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    common = dict(model="tiny", messages=USER, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = await client.chat.completions.create(**common)
    stream = await client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_completions_many_prompts_and_n(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    reply = await client.completions.create(
        model="tiny", prompt=["the cat", "and the dog"], n=2, max_tokens=5, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 20
    token_prompt = await client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert token_prompt.usage.prompt_tokens == 4
    assert token_prompt.usage.completion_tokens == 3


async def test_completions_stream(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    whole = await client.completions.create(
        model="tiny", prompt="in the", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = await client.completions.create(
        model="tiny", prompt="in the", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join([c.choices[0].text async for c in stream])
    assert text == whole.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
async def test_template_refusal_is_a_400_and_the_server_lives_on(load_tiny, make_openai, stream):
    """The seed scenario: the template raises on two user turns in a row; the
    client gets a 400 with the template's message, streaming or not, and the
    server serves the next request. (The seed sent system+user, which this
    template also refuses; like llama.cpp, lockgate now puts the system text
    into the user's turn for a template without a system role.)"""
    model = load_tiny(chat_template=ALTERNATING_TEMPLATE)
    client = await make_openai(model)
    bad = [{"role": "user", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=bad, max_tokens=4, stream=stream)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_messages"
    assert "Conversation roles must alternate" in error["message"]
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_models_listing(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


async def test_api_key(tiny_model, make_openai):
    good = await make_openai(tiny_model, api_key="s3cret", api_keys=("other", "s3cret"))
    reply = await good.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert reply.choices
    with pytest.raises(openai.AuthenticationError) as caught:
        await good.with_options(api_key="wrong").chat.completions.create(
            model="tiny", messages=USER, max_tokens=2
        )
    assert caught.value.body["code"] == "invalid_api_key"


async def test_api_key_raw(tiny_model, make_client):
    client = await make_client(tiny_model, api_keys=("s3cret",))
    assert (await client.get("/health")).status == 200
    missing = await client.get("/v1/models")
    assert missing.status == 401
    assert missing.headers["x-request-id"]
    assert (await missing.json())["error"]["type"] == "authentication_error"
    wrong_scheme = await client.get("/v1/models", headers={"Authorization": "Basic s3cret"})
    assert wrong_scheme.status == 401
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200


async def test_chat_logprobs(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    common = dict(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body={"ignore_eos": True})
    reply = await client.chat.completions.create(**common)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
        # greedy picks the most likely token
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    stream = await client.chat.completions.create(**common, stream=True)
    streamed = [e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_completions_logprobs(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    reply = await client.completions.create(
        model="tiny", prompt="the cat", max_tokens=5, temperature=1.0, seed=4, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
