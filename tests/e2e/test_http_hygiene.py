"""What browsers and hostile HTTP clients meet: CORS, content types, what
the API key guards, what never reaches the log."""

from __future__ import annotations

import json
import logging

import pytest

from error_checks import CHAT, GOOD, assert_error, assert_still_serving

ORIGIN = "https://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


@pytest.mark.parametrize("api_keys", [(), ("k",)], ids=["no-key", "with-key"])
async def test_preflight_from_an_allowed_origin_is_answered_without_the_key(tiny_model, make_client, api_keys):
    client = await make_client(tiny_model, allowed_origins=(ORIGIN,), api_keys=api_keys)
    response = await client.options(CHAT, headers=PREFLIGHT)
    assert response.status == 204, await response.text()
    assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    # the real request then carries the headers a browser needs to read it, error or not
    auth = {"Authorization": "Bearer k"} if api_keys else {}
    answer = await client.post(CHAT, json=GOOD, headers={"Origin": ORIGIN, **auth})
    assert answer.status == 200
    assert answer.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "x-request-id" in answer.headers["Access-Control-Expose-Headers"]
    refused = await client.post(CHAT, json={**GOOD, "temperature": 7}, headers={"Origin": ORIGIN, **auth})
    assert refused.status == 400 and refused.headers["Access-Control-Allow-Origin"] == ORIGIN
    streamed = await client.post(CHAT, json={**GOOD, "stream": True}, headers={"Origin": ORIGIN, **auth})
    assert streamed.headers["Access-Control-Allow-Origin"] == ORIGIN
    await streamed.read()


async def test_any_origin_with_a_star(tiny_model, make_client):
    client = await make_client(tiny_model, allowed_origins=("*",))
    response = await client.options(CHAT, headers={**PREFLIGHT, "Origin": "http://localhost:3000"})
    assert response.status == 204
    assert response.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


@pytest.mark.parametrize("allowed", [(), ("https://other.example",)], ids=["none-by-default", "another-origin"])
async def test_other_origins_get_no_cors(tiny_model, make_client, allowed):
    client = await make_client(tiny_model, allowed_origins=allowed)
    await assert_error(await client.options(CHAT, headers=PREFLIGHT), 403, "permission_error", "origin_not_allowed")
    answer = await client.post(CHAT, json=GOOD, headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in answer.headers


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/json; charset=latin-1"],
)
async def test_a_body_not_declared_json_is_a_415(tiny_model, make_client, content_type):
    """A browser sends these cross-origin without a preflight: refusing them
    keeps web pages off the API unless --allowed-origins lets them in."""
    client = await make_client(tiny_model)
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = await client.post(CHAT, data=json.dumps(GOOD).encode(), headers=headers)
    if content_type is None:
        # aiohttp's client labels bare bytes application/octet-stream
        assert response.request_info.headers.get("Content-Type") in (None, "application/octet-stream")
    error = await assert_error(response, 415, "invalid_request_error", "unsupported_media_type")
    assert "application/json" in error["message"] or "UTF-8" in error["message"]
    await assert_still_serving(client)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/json; charset=UTF8",
                                          "application/merge-patch+json"])
async def test_json_content_types_are_read(tiny_model, make_client, content_type):
    client = await make_client(tiny_model)
    response = await client.post(CHAT, data=json.dumps(GOOD).encode(), headers={"Content-Type": content_type})
    assert response.status == 200, await response.text()


async def test_metrics_need_the_key(tiny_model, make_client):
    client = await make_client(tiny_model, api_keys=("k",))
    await assert_error(await client.get("/metrics"), 401, "authentication_error")
    assert (await client.get("/metrics", headers={"Authorization": "Bearer k"})).status == 200
    assert (await client.get("/health")).status == 200


async def test_metrics_public_opens_metrics_alone(tiny_model, make_client):
    client = await make_client(tiny_model, api_keys=("k",), metrics_public=True)
    assert (await client.get("/metrics")).status == 200
    await assert_error(await client.post(CHAT, json=GOOD), 401, "authentication_error")


@pytest.mark.parametrize("value", [b"Bearer k\xff", b"Bearer \xed\xa0\x80", b"Bearer k\xe9"])
async def test_an_authorization_header_that_is_not_utf8_is_a_401(tiny_model, make_client, value):
    """aiohttp keeps such bytes as surrogates; encoding them for the
    constant-time comparison must not raise (a 500)."""
    import asyncio

    client = await make_client(tiny_model, api_keys=("k",))
    url = client.make_url("/")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    body = json.dumps(GOOD).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nAuthorization: " + value + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"401", answer
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"


async def test_keys_bodies_and_prompts_stay_out_of_the_log(tiny_model, make_client, caplog):
    client = await make_client(tiny_model, api_keys=("secret-key-123",))
    caplog.set_level(logging.DEBUG)
    secret_prompt = "my-secret-prompt-text"
    body = {**GOOD, "messages": [{"role": "user", "content": secret_prompt}]}
    for headers in ({"Authorization": "Bearer secret-key-123"}, {"Authorization": "Bearer wrong-secret-key"}):
        await client.post(CHAT, json=body, headers=headers)
        await client.post(CHAT, json={**body, "temperature": 9}, headers=headers)
    logged = caplog.text + "".join(str(r.msg) for r in caplog.records)
    assert "request" in logged  # the summary lines are there
    for secret in ("secret-key-123", "wrong-secret-key", secret_prompt):
        assert secret not in logged, secret


async def test_template_syntax_in_a_message_is_text(tiny_model, make_client):
    """Messages are data to the chat template, never template code."""
    client = await make_client(tiny_model)
    body = {"model": "tiny", "max_tokens": 1, "logprobs": False,
            "messages": [{"role": "user", "content": "{{ 7 * 7 }}{% raw %}"}]}
    response = await client.post(CHAT, json=body)
    assert response.status == 200, await response.text()
    rendered = tiny_model.tokenizer.apply_chat_template(body["messages"], tokenize=False)
    assert "{{ 7 * 7 }}" in rendered and "49" not in rendered


async def test_a_client_cannot_send_its_own_chat_template(tiny_model, make_client):
    client = await make_client(tiny_model)
    body = {**GOOD, "chat_template": "{{ messages }}"}
    await assert_error(await client.post(CHAT, json=body), 400, "invalid_request_error",
                       "unsupported_parameter", "chat_template")


@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
    ids=["request-line", "header-over-8-KiB", "negative-length", "bad-chunk"],
)
async def test_what_the_http_parser_refuses_is_a_400_and_the_server_serves_on(tiny_model, make_client, request_bytes):
    """aiohttp answers these itself, in plain text, before any lockgate code
    runs (README, Errors); they must stay 4xx and harmless."""
    import asyncio

    client = await make_client(tiny_model)
    url = client.make_url("/")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(request_bytes)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"400", answer[:300]
    await assert_still_serving(client)


async def test_a_client_that_stops_reading_is_cut_off_without_stalling_others(
    load_tiny, make_client, monkeypatch, caplog
):
    """A stream whose writes never complete (a client that keeps its
    connection open and reads nothing) neither holds up another stream nor
    keeps generating: past the backlog limit its request is aborted and its
    KV pages freed, and past the write timeout its connection is closed."""
    import asyncio

    from aiohttp import web

    from helpers import wait_idle
    from lockgate.server import serving

    monkeypatch.setattr(serving, "STREAM_BACKLOG_LIMIT", 8)
    monkeypatch.setattr(serving, "STREAM_WRITE_TIMEOUT_SECONDS", 2.0)
    write = web.StreamResponse.write
    stuck = asyncio.Event()

    async def write_unless_stuck(self, data):
        if self._req is not None and self._req.headers.get("x-stuck"):
            stuck.set()
            await asyncio.Event().wait()  # never returns: the client reads nothing
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write_unless_stuck)
    model = load_tiny()
    client = await make_client(model)
    finished = []  # what the engine reports of each request it retires
    monkeypatch.setattr(model.engine.observer, "request_finished", lambda **report: finished.append(report))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    slow = asyncio.ensure_future(client.post(CHAT, json=body, headers={"x-stuck": "1"}))
    await asyncio.wait_for(stuck.wait(), 30)
    normal = await client.post(CHAT, json={**body, "max_tokens": 40})
    text = await normal.text()
    assert normal.status == 200 and text.rstrip().endswith("data: [DONE]")
    stats = await wait_idle(model.engine)
    assert stats.kv_pages_used == 0 and stats.requests_running == 0, stats
    assert "client too slow: request aborted" in caplog.text
    # the stuck request was aborted, not run to its 300 tokens (which would free its pages too)
    outcomes = sorted((report["outcome"], report["completion_tokens"]) for report in finished)
    assert len(outcomes) == 2 and outcomes[1] == ("success", 40), outcomes
    assert outcomes[0][0] == "aborted" and outcomes[0][1] < 300, outcomes
    # the stuck stream's connection is closed once its write times out
    try:
        answer = await asyncio.wait_for(slow, 30)
        await asyncio.wait_for(answer.read(), 30)
    except Exception:  # noqa: BLE001 - a cut connection is what is expected
        pass
    assert "client stopped reading: its stream is closed" in caplog.text
