"""The prefix cache on the real TVM executor (tiny model), through the openai
SDK: identical outputs with and without it, what it reports, what it
prefills, eviction under a small KV cache, and no page leaked.

The scheduler's own rules are tested without TVM in test_scheduler.py."""

from __future__ import annotations

import asyncio
import re

import pytest

from tiny_model import tiny_vocab

#: TVM's KV page size
PAGE = 16
VOCAB = len(tiny_vocab())


def ids(start: int, count: int) -> list[int]:
    """`count` token ids, from a stretch of the vocabulary past the specials."""
    return [3 + (start + i) % (VOCAB - 3) for i in range(count)]


@pytest.fixture(scope="module")
def cached(load_tiny):
    return load_tiny()


@pytest.fixture(scope="module")
def uncached(load_tiny):
    return load_tiny(prefix_cache=False)


def pages_agree(model) -> None:
    """The scheduler's page book, the engine's gauges and the executor agree."""
    engine = model.engine
    assert engine.scheduler.book.free == model.executor.free_pages()
    stats = engine.stats()
    assert stats.kv_pages_used + stats.kv_pages_cached + model.executor.free_pages() == stats.kv_pages_total


@pytest.mark.parametrize("shared", [2 * PAGE, 2 * PAGE + 5], ids=["on-a-page-boundary", "mid-page"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
async def test_outputs_are_identical_with_and_without_the_cache(cached, uncached, make_openai, shared, sampling):
    with_cache, without = await make_openai(cached), await make_openai(uncached)
    prefix = ids(shared * 3, shared)
    prompts = [prefix + ids(500, 4), prefix + ids(600, 7), prefix + ids(500, 4) + ids(700, 3)]
    for prompt in prompts:
        answers = []
        for client in (with_cache, without):
            reply = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, logprobs=1, extra_body={"ignore_eos": True},
                **sampling,
            )
            answers.append(reply)
        assert answers[0].choices[0].text == answers[1].choices[0].text
        assert answers[0].choices[0].logprobs.tokens == answers[1].choices[0].logprobs.tokens
        assert answers[1].usage.prompt_tokens_details.cached_tokens == 0
    # every prompt after the first found at least the shared prefix
    assert answers[0].usage.prompt_tokens_details.cached_tokens >= shared
    pages_agree(cached)


async def test_a_shared_prefix_is_reported_and_only_the_rest_is_prefilled(load_instrumented, make_openai):
    model = load_instrumented()
    client = await make_openai(model)
    system = ids(40, 3 * PAGE + 3)
    first = await client.completions.create(model="tiny", prompt=system + ids(300, 5), max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    steps = len(model.executor.steps)
    second = await client.completions.create(model="tiny", prompt=system + ids(400, 6), max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == len(system)
    prefilled = sum(
        n for step in model.executor.steps[steps:] for kind, rows in step if kind == "prefill" for n in rows.values()
    )
    assert prefilled == 6
    # the same through chat, streamed with usage: the conversation so far is cached
    messages = [{"role": "user", "content": "a b c d e f g h"}]
    answer = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "a b"}]
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens > 0
    pages_agree(model)


async def test_distinct_long_prompts_through_a_small_cache_never_fail(load_tiny, make_openai):
    model = load_tiny(executor_options={"max_total_tokens": 8 * PAGE})  # 8 pages of 16 tokens
    client = await make_openai(model)
    for i in range(12):
        reply = await client.completions.create(
            model="tiny", prompt=ids(i * 61, 5 * PAGE), max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].finish_reason == "length"
        pages_agree(model)
        stats = model.engine.stats()
        assert stats.kv_pages_used == 0 and stats.kv_pages_cached <= stats.kv_pages_total
    assert model.engine.preemptions == 0


async def test_forks_preemptions_and_aborts_with_cached_prefixes_leak_no_page(load_tiny, make_client):
    model = load_tiny(executor_options={"max_total_tokens": 12 * PAGE}, max_n=4)
    client = await make_client(model)
    system = ids(10, 2 * PAGE + 4)
    response = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": system + [5], "max_tokens": 2, "temperature": 0}
    )
    assert response.status == 200

    async def one(i):
        body = {"model": "tiny", "prompt": system + ids(i * 7, 3), "max_tokens": 24, "n": 3,
                "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": i % 2 == 0}
        if i % 3 == 2:  # a client that leaves early
            response = await client.post("/v1/completions", json=body)
            await response.content.readany()
            response.close()
            return None
        response = await client.post("/v1/completions", json=body)
        assert response.status == 200, await response.text()
        return await response.text()

    await asyncio.gather(*(one(i) for i in range(8)))
    for _ in range(200):  # aborts are processed by the engine thread
        if model.engine.stats().requests_running == 0:
            break
        await asyncio.sleep(0.05)
    assert model.engine.preemptions > 0
    text = await (await client.get("/metrics")).text()
    assert 'lockgate_kv_pages_used{model="tiny"} 0.0' in text
    cached = float(re.search(r'lockgate_kv_pages_cached\{model="tiny"\} (\S+)', text)[1])
    assert cached == model.engine.stats().kv_pages_cached > 0
    hits = float(re.search(r'lockgate_prefix_cache_hits_total\{model="tiny"\} (\S+)', text)[1])
    queries = float(re.search(r'lockgate_prefix_cache_queries_total\{model="tiny"\} (\S+)', text)[1])
    assert queries >= 9 and hits >= len(system)
    pages_agree(model)


async def test_with_the_cache_off_nothing_is_cached(uncached, make_openai):
    client = await make_openai(uncached)
    prompt = ids(5, 3 * PAGE)
    for _ in range(2):
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert uncached.engine.stats().kv_pages_cached == 0
    assert uncached.executor.free_pages() == uncached.executor.total_pages


def test_the_flag_turns_it_off():
    from lockgate.server.config import serve_parser, settings_from_args

    assert settings_from_args(serve_parser().parse_args([])).engine_options().prefix_cache is True
    settings = settings_from_args(serve_parser().parse_args(["--no-prefix-cache"]))
    assert settings.engine_options().prefix_cache is False
