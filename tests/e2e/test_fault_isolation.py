"""Faults injected into every pipeline hook and into executor steps: the
request fails cleanly, others are unaffected, no KV pages leak."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

import lockgate.engine.loop
import lockgate.engine.state
from helpers import wait_for, wait_idle
from lockgate import hookimpl
from lockgate.engine import Engine
from lockgate.errors import InvalidRequestError

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
POISON = 77  # a token id whose prefill the faulty executor refuses


class FaultyExecutor:
    """Test double: delegates to a real executor, raises where `fail` says."""

    def __init__(self, real, fail):
        self.real = real
        self.fail = fail
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def prefill(self, seq_ids, token_ids, all_positions=None):
        self.calls += 1
        if self.fail("prefill", token_ids):
            raise RuntimeError("injected prefill failure")
        return self.real.prefill(seq_ids, token_ids, all_positions)

    def decode(self, seq_ids, token_ids):
        self.calls += 1
        if self.fail("decode", token_ids):
            raise RuntimeError("injected decode failure")
        return self.real.decode(seq_ids, token_ids)


def with_faulty_executor(model, fail):
    executor = FaultyExecutor(model.executor, fail)
    engine = Engine(
        executor,
        model.tokenizer,
        eos_token_ids=model.eos_token_ids,
        context_length=model.config.context_length,
        name="faulty",
    )
    return dataclasses.replace(model, executor=executor, engine=engine)


#: longest a held decode waits for the abort: the 480 decodes of a request
#: that is never aborted take minutes, far past the tests' 60 s deadline
HOLD_SECONDS = 0.5


def holding_decodes_until_an_abort(model, monkeypatch):
    """The model on an engine whose decodes wait (up to HOLD_SECONDS each)
    until it is asked to abort a request: a request cannot run to its end
    before its abort arrives. Returns (model, the abort event, decode calls so
    far)."""
    aborted = threading.Event()
    decodes = []

    def hold(kind, token_ids):
        if kind == "decode":
            decodes.append(len(token_ids))
            aborted.wait(HOLD_SECONDS)
        return False

    model = with_faulty_executor(model, hold)
    real_abort = model.engine.abort

    def abort(handle):
        real_abort(handle)
        aborted.set()

    monkeypatch.setattr(model.engine, "abort", abort)
    return model, aborted, decodes


def poisoned(kind, token_ids):
    return kind == "prefill" and any(POISON in chunk for chunk in token_ids)


async def read_events(response):
    events = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_executor_failure_fails_only_its_request(load_tiny, make_client):
    model = with_faulty_executor(load_tiny(), poisoned)
    client = await make_client(model)
    long_body = {
        "model": "tiny", "prompt": "the cat", "max_tokens": 200, "ignore_eos": True, "stream": True,
    }
    survivor = await client.post("/v1/completions", json=long_body)
    assert survivor.status == 200
    first = await survivor.content.readline()
    assert first.startswith(b"data: ")
    # the survivor is decoding; the poisoned request's prefill fails
    failed = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, POISON, 6]})
    error = (await failed.json())["error"]
    assert failed.status == 500
    assert error["code"] == "internal_error" and "injected" not in error["message"]
    rest = await read_events(survivor)
    assert rest[-1] == "[DONE]"
    texts = [e for e in rest if isinstance(e, dict)]
    assert all("error" not in e for e in texts)
    assert texts[-1]["choices"][0]["finish_reason"] == "length"
    assert (await wait_idle(model.engine)).kv_pages_used == 0
    assert (await client.get("/health")).status == 200
    ok = await client.post(CHAT, json=GOOD)
    assert ok.status == 200


async def test_executor_failure_mid_stream_is_an_error_event(load_tiny, make_client):
    decode_calls = {"n": 0}

    def fail_third_decode(kind, token_ids):
        if kind == "decode":
            decode_calls["n"] += 1
            return decode_calls["n"] == 3
        return False

    model = with_faulty_executor(load_tiny(), fail_third_decode)
    client = await make_client(model)
    response = await client.post(CHAT, json={**GOOD, "max_tokens": 20, "ignore_eos": True, "stream": True})
    assert response.status == 200
    events = await read_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert (await wait_idle(model.engine)).kv_pages_used == 0
    assert (await client.post(CHAT, json=GOOD)).status == 200


async def test_repeated_failures_turn_health_to_503(load_tiny, make_client):
    model = with_faulty_executor(load_tiny(), lambda kind, token_ids: True)
    client = await make_client(model)
    for _ in range(lockgate.engine.loop.UNHEALTHY_AFTER_FAILURES):
        assert (await client.post(CHAT, json=GOOD)).status == 500
    health = await client.get("/health")
    assert health.status == 503
    assert "failed in a row" in (await health.json())["error"]["message"]
    refused = await client.post(CHAT, json=GOOD)
    assert refused.status == 503 and refused.headers["Retry-After"]
    assert (await wait_idle(model.engine)).kv_pages_used == 0


def fault_plugin(hook, error):
    """A plugin whose `hook` raises `error` for requests whose id starts with "fault"."""
    name = hook
    argnames = {
        "lockgate_validate_request": "request",
        "lockgate_render_prompt": "request",
        "lockgate_tokenize": "request",
        "lockgate_enqueue": "work",
    }[hook]
    # pluggy matches implementations to specs by argument names, so spell them out
    namespace: dict = {}
    exec(
        f"def {name}(self, {argnames}):\n"
        f"    request_id = getattr({argnames}, 'request_id', None) or {argnames}.id\n"
        f"    if request_id.startswith('fault'):\n"
        f"        raise error\n",
        {"error": error},
        namespace,
    )
    impl = hookimpl(tryfirst=True)(namespace[name])
    return type(f"Fault_{hook}", (), {name: impl})()


@pytest.mark.parametrize(
    "hook",
    ["lockgate_validate_request", "lockgate_render_prompt", "lockgate_tokenize", "lockgate_enqueue"],
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "error, status", [(RuntimeError("boom"), 500), (InvalidRequestError("no", param="x"), 400)]
)
async def test_exception_in_each_pipeline_hook(tiny_model, make_client, hook, stream, error, status):
    client = await make_client(tiny_model, plugins=[fault_plugin(hook, error)])
    body = {**GOOD, "stream": stream}
    response = await client.post(CHAT, json=body, headers={"x-request-id": "fault-1"})
    assert response.status == status
    assert (await response.json())["error"]["message"] != "boom"
    assert (await wait_idle(tiny_model.engine)).kv_pages_used == 0
    assert (await client.post(CHAT, json=body, headers={"x-request-id": "fine-1"})).status == 200


async def test_failure_inside_a_step_for_one_request(load_tiny, make_client, monkeypatch):
    """A per-request failure inside a step (here: its detokenizer) fails that
    request alone; the other request in the same batch completes."""

    class FragileDetokenizer(lockgate.engine.state.IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, *, stop=(), **kwargs):
            super().__init__(tokenizer, prompt_token_ids, stop=stop, **kwargs)
            self.fragile = "fragile" in stop

        def add(self, token_id, **kwargs):
            if self.fragile:
                raise ValueError("injected detokenizer failure")
            return super().add(token_id, **kwargs)

    monkeypatch.setattr(lockgate.engine.state, "IncrementalDetokenizer", FragileDetokenizer)
    model = load_tiny()
    client = await make_client(model)
    body = {**GOOD, "max_tokens": 30, "ignore_eos": True}
    good, bad = await asyncio.gather(
        client.post(CHAT, json={**body, "stop": "sturdy"}), client.post(CHAT, json={**body, "stop": "fragile"})
    )
    assert bad.status == 500
    assert good.status == 200
    assert (await good.json())["usage"]["completion_tokens"] == 30
    assert (await wait_idle(model.engine)).kv_pages_used == 0
    assert model.engine.healthy


async def test_client_disconnect_frees_pages(load_tiny, make_client, monkeypatch):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 480, "ignore_eos": True}
    # gone mid-stream
    model, aborted, decodes = holding_decodes_until_an_abort(load_tiny(), monkeypatch)
    client = await make_client(model)
    response = await client.post("/v1/completions", json={**body, "stream": True})
    await response.content.readline()
    response.close()
    await wait_for(aborted.is_set, what="abort of the request")
    stats = await wait_idle(model.engine)
    assert (stats.requests_running, stats.requests_waiting, stats.kv_pages_used) == (0, 0, 0)
    assert len(decodes) < 100  # aborted, not finished (480 asked)

    # gone while waiting for a whole completion
    model, aborted, decodes = holding_decodes_until_an_abort(load_tiny(), monkeypatch)
    client = await make_client(model)
    task = asyncio.ensure_future(client.post("/v1/completions", json=body))
    await wait_for(lambda: model.engine.stats().requests_running > 0, what="running request")
    task.cancel()
    await wait_for(aborted.is_set, what="abort of the request")
    stats = await wait_idle(model.engine)
    assert stats.requests_running == 0 and stats.kv_pages_used == 0
    assert len(decodes) < 100


async def test_grammar_failure_fails_only_its_request(load_tiny, make_client, monkeypatch):
    import lockgate.engine.structured

    real_allowed = lockgate.engine.structured.Matcher.allowed
    calls = {"n": 0}

    def allowed(self, width):
        calls["n"] += 1
        if calls["n"] == 3:
            raise lockgate.engine.structured.MatcherError("injected grammar failure")
        return real_allowed(self, width)

    monkeypatch.setattr(lockgate.engine.structured.Matcher, "allowed", allowed)
    model = load_tiny()
    client = await make_client(model)
    plain = {**GOOD, "max_tokens": 40, "ignore_eos": True}
    constrained = {**GOOD, "max_tokens": 40, "response_format": {"type": "json_object"}}
    good, bad = await asyncio.gather(client.post(CHAT, json=plain), client.post(CHAT, json=constrained))
    assert bad.status == 500
    assert good.status == 200 and (await good.json())["usage"]["completion_tokens"] == 40
    assert (await wait_idle(model.engine)).kv_pages_used == 0
    assert model.engine.healthy


async def test_client_gone_during_the_pipeline_leaves_nothing_running(load_tiny, make_client, monkeypatch):
    rendering, gate = threading.Event(), threading.Event()

    class SlowTemplate:
        @hookimpl(tryfirst=True)
        def lockgate_render_prompt(self, request):
            rendering.set()
            gate.wait(60)  # the client gives up while this runs

    model, aborted, decodes = holding_decodes_until_an_abort(load_tiny(), monkeypatch)
    client = await make_client(model, plugins=[SlowTemplate()])
    body = {**GOOD, "max_tokens": 400, "ignore_eos": True}
    task = asyncio.ensure_future(client.post(CHAT, json=body))
    await wait_for(rendering.is_set, what="call of lockgate_render_prompt")
    task.cancel()

    async def server_saw_the_client_leave():
        text = await (await client.get("/metrics")).text()
        return 'lockgate_requests_total{error_type="",outcome="aborted"} 1.0' in text

    await wait_for(server_saw_the_client_leave)
    assert model.engine.stats().requests_waiting == 0 and not aborted.is_set()
    gate.set()  # the pipeline now enqueues the request of a client that has left
    await wait_for(aborted.is_set, what="abort of the request")
    stats = await wait_idle(model.engine)
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    assert stats.kv_pages_used == 0
    assert len(decodes) < 100  # aborted, not finished (400 asked)
