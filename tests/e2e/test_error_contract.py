"""Every row of the README's error table, and hostile bodies, answered in the
OpenAI error shape with `x-request-id`, the server serving on afterwards."""

from __future__ import annotations

import asyncio
import re

import pytest

from helpers import wait_for, wait_idle
from lockgate import hookimpl
from error_checks import CHAT, GOOD, assert_error, assert_still_serving
from helpers import ALTERNATING_TEMPLATE

@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b'{"model": "tiny", "temperature": NaN}', "not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b'{"model": "tiny", "messages": "\xc3\x28"}', "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    ],
)
async def test_unparseable_bodies(tiny_model, make_client, data, fragment):
    client = await make_client(tiny_model)
    response = await client.post(CHAT, data=data, headers={"Content-Type": "application/json"})
    error = await assert_error(response, 400, "invalid_request_error")
    assert fragment in error["message"]
    await assert_still_serving(client)


COMPLETIONS = "/v1/completions"
# \ud800 as the JSON escape: Python's parser accepts it, UTF-8 cannot encode it
LONE = "a\\ud800b"


@pytest.mark.parametrize(
    "template",
    [
        "{% for message in messages %}{{ message['content'] }}",  # never closed: a syntax error
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # what the sandbox forbids
    ],
    ids=["syntax-error", "sandbox-escape"],
)
async def test_a_broken_template_is_the_servers_fault_not_the_clients(load_tiny, make_client, template, caplog):
    """The same conversation a working template renders: a 500 (the openai
    SDK retries it, and the operator's log says why), not a 400 that would
    blame the client."""
    client = await make_client(load_tiny(chat_template=template))
    error = await assert_error(await client.post(CHAT, json=GOOD), 500, "server_error", "internal_error")
    assert "template" not in error["message"]  # details stay in the log
    assert "Template" in caplog.text or "Security" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "route, body, param",
    [
        (CHAT, f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages[0].content"),
        (CHAT, '{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": '
               f'[{{"type": "text", "text": "fine"}}, {{"type": "text", "text": "{LONE}"}}]}}]}}',
         "messages[1].content[1].text"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi", "name": "{LONE}"}}]}}', "messages[0].name"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": "{LONE}"}}', "stop"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["x", "{LONE}"]}}', "stop[1]"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "user": "{LONE}"}}', "user"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "logit_bias": {{"{LONE}": 1}}}}',
         "logit_bias"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
               f'"json_schema": {{"name": "x", "schema": {{"type": "string", "pattern": "{LONE}"}}}}}}}}',
         "response_format.json_schema.schema.pattern"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "{LONE}": 1}}', None),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "x": "\\udc00"}', "x"),
        (COMPLETIONS, f'{{"prompt": "{LONE}"}}', "prompt"),
        (COMPLETIONS, f'{{"prompt": ["fine", "{LONE}"]}}', "prompt[1]"),
    ],
)
async def test_strings_that_are_not_valid_unicode_are_a_400_naming_the_field(
    tiny_model, make_client, route, body, param, stream
):
    """Each used to reach the template, tokenizer or grammar compiler and
    come back a 500 (`TextEncodeInput must be Union[...]`)."""
    client = await make_client(tiny_model)
    data = body[:-1] + f', "model": "tiny", "max_tokens": 2, "stream": {str(stream).lower()}}}'
    response = await client.post(route, data=data.encode(), headers={"Content-Type": "application/json"})
    error = await assert_error(response, 400, "invalid_request_error", "invalid_value")
    assert error["param"] == param
    assert "not valid Unicode" in error["message"] and "unpaired surrogate" in error["message"]
    await assert_still_serving(client)


async def test_a_surrogate_pair_is_an_ordinary_character(tiny_model, make_client):
    client = await make_client(tiny_model)
    data = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    response = await client.post(CHAT, data=data, headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()



@pytest.mark.parametrize(
    "body, param",
    [
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "temperature": 2.5}, "temperature"),
        ({**GOOD, "max_tokens": True}, "max_tokens"),
        ({**GOOD, "messages": {"role": "user"}}, "messages"),
        ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({**GOOD, "model": 42}, "model"),
        ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ],
)
async def test_wrong_types_and_values(tiny_model, make_client, body, param):
    client = await make_client(tiny_model)
    await assert_error(await client.post(CHAT, json=body), 400, "invalid_request_error", param=param)
    await assert_still_serving(client)


async def test_unknown_model_is_404(tiny_model, make_client):
    client = await make_client(tiny_model)
    response = await client.post(CHAT, json={**GOOD, "model": "gpt-9"})
    await assert_error(response, 404, "invalid_request_error", "model_not_found", "model")


async def test_unknown_route_and_wrong_method(tiny_model, make_client):
    client = await make_client(tiny_model)
    await assert_error(await client.get("/v1/nothing"), 404, "invalid_request_error")
    response = await client.get(CHAT)
    await assert_error(response, 405, "invalid_request_error")
    assert "POST" in response.headers["Allow"]
    await assert_still_serving(client)


async def test_oversized_body_is_413(tiny_model, make_client):
    client = await make_client(tiny_model, max_body_size=1024)
    body = {**GOOD, "messages": [{"role": "user", "content": "x" * 4096}]}
    error = await assert_error(
        await client.post(CHAT, json=body), 413, "invalid_request_error", "request_too_large"
    )
    assert "1024" in error["message"]
    await assert_still_serving(client)


async def test_template_refusal_is_invalid_messages(load_tiny, make_client):
    client = await make_client(load_tiny(chat_template=ALTERNATING_TEMPLATE))
    body = {**GOOD, "messages": [{"role": "assistant", "content": "hello"}]}
    error = await assert_error(
        await client.post(CHAT, json=body), 400, "invalid_request_error", "invalid_messages", "messages"
    )
    assert "Conversation roles must alternate" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_template_that_fails_on_the_request_is_a_400_not_a_500(load_tiny, make_client, stream, caplog):
    """A template whose code breaks on these messages (a Hermes tool_use
    template loops over `tools` unguarded: TypeError without tools) cannot
    render this request: a 400 the SDK does not retry, and a log line."""
    template = "{% for tool in tools %}{{ tool }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    client = await make_client(load_tiny(chat_template=template))
    error = await assert_error(
        await client.post(CHAT, json={**GOOD, "stream": stream}), 400, "invalid_request_error",
        "invalid_messages", "messages",
    )
    assert "TypeError" in error["message"] and "TypeError" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded(tiny_model, make_client, stream):
    client = await make_client(tiny_model)
    long_prompt = {**GOOD, "stream": stream, "messages": [{"role": "user", "content": "the cat " * 400}]}
    await assert_error(
        await client.post(CHAT, json=long_prompt), 400, "invalid_request_error",
        "context_length_exceeded", "messages",
    )
    too_many = {**GOOD, "stream": stream, "max_tokens": tiny_model.context_length}
    error = await assert_error(
        await client.post(CHAT, json=too_many), 400, "invalid_request_error",
        "context_length_exceeded", "max_tokens",
    )
    assert str(tiny_model.context_length) in error["message"]
    completion = {"model": "tiny", "prompt": [5] * tiny_model.context_length, "stream": stream}
    await assert_error(
        await client.post("/v1/completions", json=completion), 400, "invalid_request_error",
        "context_length_exceeded", "prompt",
    )
    assert (await wait_idle(tiny_model.engine)).kv_pages_used == 0


@pytest.mark.parametrize("route, body", [
    (CHAT, {**GOOD, "messages": [{"role": "user", "content": "a" * 900_000}]}),
    ("/v1/completions", {"model": "tiny", "prompt": "\u00e9t\u00e9 " * 200_000}),
])
async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_model, make_client, route, body):
    """Whatever its tokens, a prompt of more characters than the context
    times the longest token's is over the context: no tokenizer run (a
    million characters cost a third of a second and about 25 MB of
    transient memory)."""
    tokenized = []

    class Spy:
        @hookimpl(tryfirst=True)
        def lockgate_tokenize(self, prompt):
            tokenized.append(len(prompt))

    client = await make_client(tiny_model, plugins=[Spy()])
    error = await assert_error(await client.post(route, json=body), 400, "invalid_request_error",
                               "context_length_exceeded", "messages" if route == CHAT else "prompt")
    assert "at least" in error["message"] and str(tiny_model.context_length) in error["message"]
    assert tokenized == []
    # one that might fit is still tokenized and counted exactly
    response = await client.post(route, json={**body, "messages": [{"role": "user", "content": "a b " * 900}]}
                                 if route == CHAT else {**body, "prompt": "a b " * 900})
    assert tokenized and response.status == 400
    assert "at least" not in (await response.json())["error"]["message"]


async def test_missing_api_key_is_401(tiny_model, make_client):
    client = await make_client(tiny_model, api_keys=("k",))
    await assert_error(await client.post(CHAT, json=GOOD), 401, "authentication_error", "invalid_api_key")


async def test_queue_full_is_429_with_retry_after(load_tiny, make_client):
    """One running sequence and one waiting slot: a burst gets some 429s, every
    admitted request completes, nothing is answered 5xx."""
    model = load_tiny(max_queue=1, executor_options={"max_num_seqs": 1})
    client = await make_client(model)
    body = {**GOOD, "max_tokens": 40, "ignore_eos": True}
    responses = await asyncio.gather(*(client.post(CHAT, json=body) for _ in range(8)))
    statuses = sorted(r.status for r in responses)
    assert 429 in statuses and 200 in statuses
    assert set(statuses) <= {200, 429}
    for response in responses:
        if response.status == 429:
            await assert_error(response, 429, "rate_limit_error", "server_busy")
            assert int(response.headers["Retry-After"]) >= 1
        else:
            body_ = await response.json()
            assert body_["usage"]["completion_tokens"] == 40
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_shutting_down_is_503(load_tiny, make_client):
    model = load_tiny()
    client = await make_client(model)
    await asyncio.get_running_loop().run_in_executor(None, model.engine.shutdown)
    response = await client.post(CHAT, json=GOOD)
    await assert_error(response, 503, "server_error", "unavailable")
    assert response.headers["Retry-After"]
    await assert_error(await client.get("/health"), 503, "server_error", "unavailable")


class ExplodingValidator:
    @hookimpl
    def lockgate_validate_request(self, request):
        raise RuntimeError("secret internal detail /etc/passwd")


async def test_unexpected_exception_is_a_generic_500(tiny_model, make_client):
    client = await make_client(tiny_model, plugins=[ExplodingValidator()])
    response = await client.post(CHAT, json=GOOD)
    error = await assert_error(response, 500, "server_error", "internal_error")
    assert "secret" not in error["message"] and "Traceback" not in error["message"]
    assert response.headers["x-request-id"] in error["message"]


async def test_client_request_id_is_echoed(tiny_model, make_client):
    client = await make_client(tiny_model)
    response = await client.post(CHAT, json=GOOD, headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert (await response.json())["id"] == "chatcmpl-abc-123"
    hostile = await client.get("/health", headers={"x-request-id": "a b\tc" * 100})
    assert hostile.headers["x-request-id"] != "a b\tc" * 100


async def test_metrics_track_requests_and_return_to_zero(load_tiny, make_client):
    model = load_tiny()
    client = await make_client(model, api_keys=("k",))
    auth = {"Authorization": "Bearer k"}
    long = {**GOOD, "max_tokens": 300, "ignore_eos": True, "stream": True}
    streaming = await client.post(CHAT, json=long, headers=auth)
    await streaming.content.readline()

    async def metrics_text():
        return await (await client.get("/metrics", headers=auth)).text()  # behind the key, unlike /health

    async def generating():  # the first line is sent before the engine admits the request
        text = await metrics_text()
        running = 'lockgate_requests_running{model="tiny"} 1.0' in text
        return running and 'lockgate_kv_pages_used{model="tiny"} 0.0' not in text

    await wait_for(generating)
    streaming.close()  # the client goes away mid-stream
    assert (await client.post(CHAT, json=GOOD, headers=auth)).status == 200
    assert (await client.post(CHAT, json={**GOOD, "temperature": 9}, headers=auth)).status == 400
    await wait_idle(model.engine)

    async def settled():  # the streaming request is counted once its handler has ended
        text = await metrics_text()
        return text if 'lockgate_requests_total{error_type="",outcome="aborted"} 1.0' in text else None

    text = await wait_for(settled)
    for gauge in ("requests_running", "requests_waiting", "kv_pages_used"):
        assert f'lockgate_{gauge}{{model="tiny"}} 0.0' in text, gauge
    assert 'lockgate_requests_total{error_type="",outcome="success"} 1.0' in text
    assert 'lockgate_requests_total{error_type="invalid_request_error",outcome="error"} 1.0' in text
    assert 'lockgate_requests_total{error_type="",outcome="aborted"} 1.0' in text
    assert 'lockgate_time_to_first_token_seconds_count{model="tiny"} 1.0' in text
    # the finished request's 2 tokens and what the aborted one generated
    generated = float(re.search(r'lockgate_generation_tokens_total\{model="tiny"\} (\S+)', text)[1])
    assert generated >= 3


async def test_model_without_chat_template_refuses_chat_clearly(load_tiny, make_client):
    client = await make_client(load_tiny(chat_template=""))
    error = await assert_error(await client.post(CHAT, json=GOOD), 400, "invalid_request_error", param="messages")
    assert "no chat template" in error["message"]
    completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert completion.status == 200
