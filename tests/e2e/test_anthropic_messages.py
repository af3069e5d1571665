"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`)
through the `anthropic` SDK: answers whole and streamed (the stream's final
message equal to the whole one for a seeded request), a `tool_use` ->
`tool_result` round trip, token counts, the SDK's error classes from
Anthropic's error envelope, and what the server cannot serve refused by
name."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


@pytest.fixture
def make_anthropic(make_client):
    async def make(model, **settings) -> anthropic.AsyncAnthropic:
        client = await make_client(model, **settings)
        return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=settings.get("api_keys", ["k"])[0],
                                        max_retries=0)

    return make


def as_dict(message) -> dict:
    body = message.model_dump()
    body.pop("id")
    return body


async def test_a_message_whole_and_streamed_is_the_same(default_model, make_anthropic):
    client = await make_anthropic(default_model)
    common = dict(model=default_model.name, max_tokens=24, system="You are terse.",
                  messages=[{"role": "user", "content": "Name three fruits."}],
                  extra_body={"temperature": 0.7, "seed": 7})
    whole = await client.messages.create(**common)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == default_model.name
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 10
    async with client.messages.stream(**common) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == whole.content[0].text
    assert as_dict(final)["content"] == as_dict(whole)["content"]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # count_tokens counts the prompt the answer reports
    counted = await client.messages.count_tokens(model=default_model.name, system="You are terse.",
                                                 messages=common["messages"])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


async def test_a_stop_sequence_and_max_tokens_are_the_stop_reasons(default_model, make_anthropic):
    client = await make_anthropic(default_model)
    messages = [{"role": "user", "content": "Count from 1 to 10 with commas."}]
    greedy = {"extra_body": {"temperature": 0}}
    whole = await client.messages.create(model=default_model.name, max_tokens=40, messages=messages, **greedy)
    text = whole.content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]  # two characters from the middle of the greedy answer
    assert stop.strip()
    stopped = await client.messages.create(model=default_model.name, max_tokens=40, messages=messages,
                                           stop_sequences=[stop], **greedy)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    short = await client.messages.create(model=default_model.name, max_tokens=2, messages=messages, **greedy)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_use_round_trip(default_model, make_anthropic, stream):
    client = await make_anthropic(default_model)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(model=default_model.name, max_tokens=80, messages=messages, tools=[WEATHER],
                   tool_choice={"type": "any"}, extra_body={"temperature": 0})
    if stream:
        async with client.messages.stream(**request) as events:
            kinds = [event.type async for event in events]
            reply = await events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_start" in kinds and "input_json" in kinds
    else:
        reply = await client.messages.create(**request)
    assert reply.stop_reason == "tool_use"
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = await client.messages.create(
        model=default_model.name, max_tokens=30, tools=[WEATHER], extra_body={"temperature": 0},
        messages=[*messages, {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 degrees and sunny"}]}],
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_errors_are_anthropics_and_the_sdk_raises_its_classes(tiny_model, make_anthropic, make_client):
    client = await make_anthropic(tiny_model, api_keys=("k",))
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="tiny", max_tokens=0, messages=user)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="nope", max_tokens=4, messages=user)
    wrong = anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await wrong.messages.create(model="tiny", max_tokens=4, messages=user)
    assert denied.value.body["error"]["type"] == "authentication_error"
    # the key as x-api-key is accepted: a plain answer
    ok = await client.messages.create(model="tiny", max_tokens=3, messages=user)
    assert ok.usage.output_tokens == 3 and ok.stop_reason == "max_tokens"


async def test_every_error_under_the_messages_sub_app_is_anthropics(tiny_model, make_client):
    """The sub-app carries its error writer: a route or method it lacks is
    answered in Anthropic's envelope, a neighbour under /v1 in OpenAI's."""
    client = await make_client(tiny_model)
    for method, path, status, kind in [("POST", "/v1/messages/nope", 404, "not_found_error"),
                                       ("GET", "/v1/messages", 405, "invalid_request_error"),
                                       ("GET", "/v1/messages/count_tokens", 405, "invalid_request_error")]:
        response = await client.request(method, path, json={})
        body = await response.json()
        assert response.status == status and body["type"] == "error", (path, body)
        assert body["error"]["type"] == kind and body["error"]["message"]
    for path in ("/v1/messagesx", "/v1/nope"):
        response = await client.post(path, json={})
        assert response.status == 404
        assert set((await response.json())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
     "messages[0].content[0].cache_control"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": 5}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "some"}},
     "tool_choice.type"),
    # a type that is not a string once made a 500 (the fuzzer found it)
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": {"": None}}},
     "tool_choice.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}},
     "output_config.effort"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "cache_control": {"type": "persistent"}},
     "cache_control"),
])
async def test_what_cannot_be_served_is_refused_by_name(tiny_model, make_client, body, where):
    client = await make_client(tiny_model)
    response = await client.post("/v1/messages", json={"model": "tiny", **body})
    assert response.status == 400, await response.text()
    error = await response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert where in error["error"]["message"]


async def test_an_ephemeral_cache_breakpoint_is_served_by_the_prefix_cache(tiny_model, make_anthropic):
    client = await make_anthropic(tiny_model)
    system = [{"type": "text", "text": "a long shared system prompt " * 8, "cache_control": {"type": "ephemeral"}}]
    for _ in range(2):
        reply = await client.messages.create(model="tiny", max_tokens=2, system=system,
                                             messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.cache_read_input_tokens > 0


async def test_output_config_format_holds_the_answer_to_its_schema(tiny_model, make_anthropic):
    import json

    client = await make_anthropic(tiny_model)
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
              "required": ["label"], "additionalProperties": False}
    reply = await client.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                                         output_config={"format": {"type": "json_schema", "schema": schema}})
    if reply.stop_reason == "end_turn":
        jsonschema.validate(json.loads(reply.content[0].text), schema)
    else:  # cut short: still the schema's prefix
        assert reply.content[0].text.startswith('{')
