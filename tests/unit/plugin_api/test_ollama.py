"""Ollama's bodies typed (`lockgate.plugin_api.ollama`): options to chat
fields or refused by name, calls given ids and tool turns the ids of the
calls they answer, `format` and `think` read, and the chat request each
body becomes, with its errors naming Ollama's fields."""

from __future__ import annotations

import pytest

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.fields import OLLAMA_CHAT, OLLAMA_GENERATE
from lockgate.plugin_api.ollama import parse_ollama_request, read_keep_alive, read_ollama_messages, read_options

USER = [{"role": "user", "content": "hi"}]


def chat(body: dict, *, thinks: bool = False, context_length: int = 4096):
    typed = parse_ollama_request(OLLAMA_CHAT, {"model": "m", "messages": USER, **body}, request_id="r")
    return typed.to_chat(thinks=thinks, context_length=context_length)


def test_sampling_options_are_the_chat_fields():
    read = read_options({"num_predict": 7, "temperature": 0.2, "top_k": 5, "repeat_penalty": 1.3, "stop": ["\n"],
                         "seed": 1, "num_thread": 8, "typical_p": 1.0, "mirostat": 0}, "options")
    assert read == {"max_tokens": 7, "temperature": 0.2, "top_k": 5, "repetition_penalty": 1.3, "stop": ("\n",),
                    "seed": 1}
    assert "max_tokens" not in read_options({"num_predict": -1}, "options")  # no limit: the context's
    request = chat({"options": {"num_predict": 7, "temperature": 0.2}})
    params = request.sampling_params()
    assert (params.max_tokens, params.temperature, request.stream, request.endpoint) == (7, 0.2, True, OLLAMA_CHAT)


@pytest.mark.parametrize("options, error, param", [
    ({"mirostat": 2}, UnsupportedParameter, "options.mirostat"),
    ({"temperature": 9}, InvalidRequestError, "options.temperature"),
    ({"warp_drive": 1}, InvalidRequestError, "options.warp_drive"),
    ({"num_predict": 0}, InvalidRequestError, "options.num_predict"),
])
def test_an_option_that_cannot_act_is_a_400_naming_it(options, error, param):
    with pytest.raises(error) as raised:
        read_options(options, "options")
    assert raised.value.param == param


def test_num_ctx_is_held_to_the_context():
    assert chat({"options": {"num_ctx": 2048}}, context_length=4096).messages
    with pytest.raises(UnsupportedParameter, match="context of 4096"):
        chat({"options": {"num_ctx": 8192}}, context_length=4096)


def test_calls_get_ids_and_tool_turns_answer_them_in_order():
    messages = read_ollama_messages([
        {"role": "user", "content": "weather in two cities"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Oslo"}}},
            {"function": {"name": "time", "arguments": {}}},
            {"function": {"name": "weather", "arguments": {"city": "Lima"}}}]},
        {"role": "tool", "tool_name": "weather", "content": "4 C"},
        {"role": "tool", "content": "noon"},  # no name: the earliest unanswered, `time`
        {"role": "tool", "tool_name": "weather", "content": "22 C"},
    ], "messages")
    calls = messages[1].tool_calls
    assert [c.id for c in calls] == ["call_1_0", "call_1_1", "call_1_2"]
    assert calls[0].arguments == '{"city": "Oslo"}'
    assert [m.tool_call_id for m in messages[2:]] == ["call_1_0", "call_1_1", "call_1_2"]
    with pytest.raises(InvalidRequestError) as raised:
        read_ollama_messages([*USER, {"role": "tool", "tool_name": "weather", "content": "x"}], "messages")
    assert raised.value.param == "messages[1]"


def test_format_and_think():
    assert chat({"format": "json"}).response_format.schema == {"type": "object"}  # any JSON object
    schema = chat({"format": {"type": "object", "properties": {"a": {"type": "integer"}}}}).response_format
    assert schema.kind == "json_schema" and schema.schema["properties"]["a"] == {"type": "integer"}
    assert chat({"format": ""}).response_format is None
    with pytest.raises(InvalidRequestError) as raised:
        chat({"format": 3})
    assert raised.value.param == "format"
    assert chat({"think": True}, thinks=True).chat_template_kwargs == {"enable_thinking": True}
    assert chat({"think": "low"}, thinks=True).chat_template_kwargs == {"enable_thinking": True}
    assert chat({"think": False}).chat_template_kwargs == {}  # nothing to switch off
    with pytest.raises(UnsupportedParameter) as raised:
        chat({"think": True})
    assert raised.value.param == "think"


def test_generate_is_one_user_turn_after_the_system_prompt():
    typed = parse_ollama_request(OLLAMA_GENERATE, {"model": "m", "prompt": "hi", "system": "be brief"},
                                 request_id="r")
    request = typed.to_chat(thinks=False, context_length=4096)
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "hi")]
    assert request.endpoint == OLLAMA_GENERATE and request.origin is typed
    assert request.param_for("max_tokens") == "options.num_predict" and request.param_for("schema") == "format"
    with pytest.raises(UnsupportedParameter) as raised:
        parse_ollama_request(OLLAMA_GENERATE, {"model": "m", "prompt": "hi", "raw": True}, request_id="r")
    assert raised.value.param == "raw"


@pytest.mark.parametrize("given, seconds", [
    (300, 300.0), (0, 0.0), (-1, -1.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5),
    ("250ms", 0.25), ("-1", -1.0), ("-1m", -60.0), ("0", 0.0), (None, None),
])
def test_keep_alive_reads_seconds_and_go_durations(given, seconds):
    assert read_keep_alive(given, "keep_alive") == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "m", "", True, [5], "5m3"])
def test_keep_alive_that_is_no_duration_is_a_400_naming_it(given):
    with pytest.raises(InvalidRequestError) as refused:
        read_keep_alive(given, "keep_alive")
    assert refused.value.param == "keep_alive" and "duration" in refused.value.message
