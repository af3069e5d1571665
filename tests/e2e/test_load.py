"""Many clients at once through the real SDK: batching keeps outputs exact,
overload is a clean 429, and a messy burst leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import re

import openai

from helpers import wait_idle

QUESTIONS = [f"question number {i} about the cat" for i in range(16)]


async def stream_text(client, question, **kwargs):
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": question}], stream=True, **kwargs
    )
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def test_sixteen_concurrent_streams_equal_their_single_runs(load_tiny, make_openai):
    model = load_tiny(executor_options={"max_num_seqs": 8})
    client = await make_openai(model)
    common = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    alone = [await stream_text(client, q, **common) for q in QUESTIONS]
    together = await asyncio.gather(*(stream_text(client, q, **common) for q in QUESTIONS))
    assert list(together) == alone
    assert all(finish == "length" for _, finish in together)
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_flood_beyond_the_queue_gets_429_and_no_5xx(load_tiny, make_openai):
    model = load_tiny(max_queue=4, executor_options={"max_num_seqs": 2})
    client = await make_openai(model)

    async def one(i):
        try:
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"flood {i}"}],
                max_tokens=32, extra_body={"ignore_eos": True},
            )
            return reply.usage.completion_tokens
        except openai.RateLimitError as exc:
            assert exc.response.headers["Retry-After"]
            assert exc.body["type"] == "rate_limit_error"
            return "429"

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert "429" in results
    admitted = [r for r in results if r != "429"]
    # at least the queue's worth was admitted, and every admitted request completed
    assert len(admitted) >= 4 and all(r == 32 for r in admitted)
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_burst_with_disconnects_and_preemption_leaves_nothing_behind(load_tiny, make_client):
    model = load_tiny(executor_options={"max_num_seqs": 8, "max_total_tokens": 512})
    client = await make_client(model)
    body = {"model": "tiny", "max_tokens": 120, "ignore_eos": True, "stream": True}

    async def client_run(i):
        response = await client.post(
            "/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": f"burst {i}"}]},
        )
        assert response.status == 200
        if i % 2:
            await response.content.readline()
            await response.content.readline()
            response.close()  # gone mid-stream
            return None
        events = [line for line in (await response.read()).decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"error"' not in "".join(events)
        return json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"]

    results = await asyncio.gather(*(client_run(i) for i in range(16)))
    assert [r for r in results if r is not None] == ["length"] * 8
    stats = await wait_idle(model.engine)
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    # the gauges are read from the engine when scraped
    text = await (await client.get("/metrics")).text()
    for gauge in ("requests_running", "requests_waiting", "kv_pages_used"):
        assert f'lockgate_{gauge}{{model="tiny"}} 0.0' in text, gauge
    preemptions = float(re.search(r'lockgate_preemptions_total\{model="tiny"\} (\S+)', text)[1])
    assert preemptions > 0
