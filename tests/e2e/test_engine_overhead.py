"""The engine-overhead benchmark (`benchmarks/engine_overhead.py`) and its
zero-cost executor keep working: the executor serves what it promises
through the real app, and the benchmark, run small, streams every answer
whole and right. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from helpers import wait_idle
from lockgate import hookimpl
from lockgate.engine.client import IteratedHandle
from lockgate.plugin_api.manager import get_plugin_manager
from zero_cost_executor import ZeroCostExecutors

from paths import BENCHMARKS, ROOT  # noqa: E402

sys.path.insert(0, str(BENCHMARKS))

import engine_overhead  # noqa: E402


async def _stream(client, body):
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status == 200
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for line in (await response.read()).decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    return texts, finish, usage


async def test_the_zero_cost_executor_streams_its_known_answer_through_the_app(load_tiny, tiny_gguf, make_client):
    pm = get_plugin_manager(autoload=False, plugins=[ZeroCostExecutors()])
    model = load_tiny(pm=pm, executor="zero-cost", executor_options={"max_num_seqs": 16})
    client = await make_client(model)
    prompts = [f"prompt {i} about the sea" for i in range(12)]
    expected = engine_overhead.expected_texts(str(tiny_gguf), prompts, 40)
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    results = await asyncio.gather(*(
        _stream(client, {**body, "messages": [{"role": "user", "content": p}], "n": 1 + i % 2})
        for i, p in enumerate(prompts)
    ))
    for i, (prompt, (texts, finish, usage)) in enumerate(zip(prompts, results)):
        n = 1 + i % 2
        assert texts == {index: expected[prompt] for index in range(n)}
        assert finish == {index: "length" for index in range(n)}
        assert usage["completion_tokens"] == 40 * n
    # the answer is words, not nothing: the check above has something to compare
    assert len(expected[prompts[0]].split()) > 5
    assert (await wait_idle(model.engine)).kv_pages_used == 0


def test_the_benchmark_run_small_checks_every_answer():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_overhead.py"), "--concurrency", "1,8",
         "--max-tokens", "24", "--min-requests", "8", "--rounds", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["1"], ["8"])]
    assert [row[0] for row in rows] == ["1", "8"], result.stdout
    for row in rows:
        requests, tokens = int(row[1]), int(row[2])
        assert requests == 8 and tokens == 8 * 24, row
        assert row[-2:] == ["0", "0"], row  # none wrong, none failed


class IteratingHandle(IteratedHandle):
    """A plugin's handle written as an iterator alone (as a remote engine's
    are): `IteratedHandle` reads it for the stream with a task. With
    `fail_after` it fails the request after that many deltas."""

    def __init__(self, handle, fail_after=None):
        self._handle, self._fail_after, self._seen = handle, fail_after, 0
        self.n, self.usage, self.max_tokens, self.work = handle.n, handle.usage, handle.max_tokens, handle.work

    @property
    def finished(self):
        return self._handle.finished

    async def __anext__(self):
        if self._fail_after is not None and self._seen == self._fail_after:
            from lockgate.errors import InternalError

            raise InternalError("the remote engine failed")
        self._seen += 1
        return await self._handle.__anext__()

    def abort(self):
        self.stop_reading()
        self._handle.abort()


class IteratingHandles:
    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    @hookimpl
    def lockgate_enqueue(self, work, engine):
        return IteratingHandle(engine.add(work), self.fail_after)


async def test_handles_that_can_only_be_iterated_stream_the_same(load_tiny, tiny_gguf, make_client):
    pm = get_plugin_manager(autoload=False, plugins=[ZeroCostExecutors()])
    model = load_tiny(pm=pm, executor="zero-cost", executor_options={"max_num_seqs": 16})
    prompt = "prompt about the sea"
    expected = engine_overhead.expected_texts(str(tiny_gguf), [prompt], 30)[prompt]
    body = {"model": "tiny", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "n": 3,
            "messages": [{"role": "user", "content": prompt}], "stream_options": {"include_usage": True}}
    plugin = IteratingHandles()
    client = await make_client(model, plugins=[plugin])
    texts, finish, usage = await _stream(client, body)
    assert texts == {0: expected, 1: expected, 2: expected} and set(finish.values()) == {"length"}
    assert usage["completion_tokens"] == 90
    # a failure after the stream began travels inside it, after what came before
    plugin.fail_after = 5
    response = await client.post("/v1/chat/completions", json={**body, "n": 1, "stream": True})
    events = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    streamed = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                       for e in events[:-2] if json.loads(e[6:]).get("choices"))
    assert expected.startswith(streamed) and streamed
    assert (await wait_idle(model.engine)).kv_pages_used == 0
