"""OpenAI's types and ranges, `param` naming the field: the table of bad
bodies read by `parse_request` and the validation policy without a model
(the fast tier), what only the model can refuse over HTTP, and the good
bodies answered over HTTP."""

from __future__ import annotations

import pytest

from lockgate.errors import LockgateError
from lockgate.plugin_api.request import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, parse_request
from lockgate.plugin_api.responses import parse_responses_request
from lockgate.plugins.validate import check_size

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}


def chat(**fields):
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **fields}


def completion(**fields):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


BAD = [
    (CHAT, chat(messages=[]), "messages", "invalid_value"),
    # request-level caps, before the template and tokenizer spend time
    (CHAT, chat(messages=MESSAGES * 2049), "messages", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 600_000}] * 2), "messages", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 500_001}] * 2}]),
     "messages", "invalid_value"),
    (COMPLETIONS, completion(prompt="x" * 1_000_001), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=["x" * 500_000, "y" * 500_001]), "prompt", "invalid_value"),
    (CHAT, chat(chat_template="{{ messages }}"), "chat_template", "unsupported_parameter"),
    (CHAT, chat(messages=None), "messages", "invalid_value"),
    (CHAT, chat(messages=["hi"]), "messages[0]", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "messages[0].content[0]", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": 3}]), "messages[0].name", "invalid_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "invalid_value"),
    (CHAT, chat(temperature=True), "temperature", "invalid_value"),
    (CHAT, chat(top_p=0), "top_p", "invalid_value"),
    (CHAT, chat(top_p=1.5), "top_p", "invalid_value"),
    (CHAT, chat(n=0), "n", "invalid_value"),
    (CHAT, chat(n=1.5), "n", "invalid_value"),
    (CHAT, chat(max_tokens=0), "max_tokens", "invalid_value"),
    (CHAT, chat(max_tokens="5"), "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    (CHAT, chat(stop=[1]), "stop", "invalid_value"),
    (CHAT, chat(stop=""), "stop", "invalid_value"),
    (CHAT, chat(seed=2**63), "seed", "invalid_value"),
    (CHAT, chat(seed="1"), "seed", "invalid_value"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),
    (CHAT, chat(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias=[1]), "logit_bias", "invalid_value"),
    (CHAT, chat(logprobs="yes"), "logprobs", "invalid_value"),
    (CHAT, chat(top_logprobs=3), "top_logprobs", "invalid_value"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (CHAT, chat(stream="yes"), "stream", "invalid_value"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage",
     "invalid_value"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format", "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "invalid_schema"),
    (CHAT, chat(tools={"type": "function"}), "tools", "invalid_value"),
    (CHAT, chat(tools=[{"type": "web_search"}]), "tools[0].type", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name",
     "invalid_value"),
    (CHAT, chat(tools=[TOOL, TOOL]), "tools[1].function.name", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools",
     "invalid_value"),
    (RESPONSES, {"model": "tiny", "input": "x", "tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]},
     "tools", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters", "invalid_value"),
    (CHAT, chat(tool_choice="auto"), "tool_choice", "invalid_value"),
    (CHAT, chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "invalid_value"),
    (CHAT, chat(tools=[TOOL], parallel_tool_calls="yes"), "parallel_tool_calls", "invalid_value"),
    (CHAT, chat(tools=[TOOL], response_format={"type": "json_object"}), "response_format", "unsupported_parameter"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "nope"}]), "messages[0].tool_call_id",
     "invalid_value"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", "invalid_value"),
    (CHAT, chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": ["a"]}]),
     "messages[0].reasoning_content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls",
     "invalid_value"),
    (CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"type": "function",
        "function": {"name": "f", "arguments": "{}"}}]}]), "messages[0].tool_calls[0].id", "invalid_value"),
    (CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
        "function": {"name": "f", "arguments": {}}}]}]), "messages[0].tool_calls[0].function.arguments",
     "invalid_value"),
    *[(CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
        "function": {"name": "f", "arguments": arguments}}]}]), "messages[0].tool_calls[0].function.arguments",
        "invalid_value") for arguments in ("{", "[1]", "null")],
    (RESPONSES, {"model": "tiny", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments", "invalid_value"),
    (CHAT, chat(top_k=-2), "top_k", "invalid_value"),
    (CHAT, chat(min_p=1.5), "min_p", "invalid_value"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    (CHAT, chat(ignore_eos=1), "ignore_eos", "invalid_value"),
    (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids", "invalid_value"),
    (COMPLETIONS, completion(prompt=None), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=5), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[[1], []]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[[1], [-4]]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(logprobs=21), "logprobs", "invalid_value"),
    (COMPLETIONS, completion(echo=1), "echo", "invalid_value"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens", "invalid_value"),
    (COMPLETIONS, completion(max_tokens=-1, echo=True), "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
    (COMPLETIONS, completion(suffix="x"), "suffix", "unsupported_parameter"),
    (COMPLETIONS, completion(best_of=3), "best_of", "unsupported_parameter"),
    # fail closed: a field in no row, one refused, one accepted of the wrong type
    (CHAT, chat(foo_bar=1), "foo_bar", "unknown_parameter"),
    (COMPLETIONS, completion(chat_template="x"), "chat_template", "unknown_parameter"),
    (RESPONSES, {"model": "tiny", "input": "x", "messages": []}, "messages", "unknown_parameter"),
    (CHAT, chat(typical_p=0.9), "typical_p", "unsupported_parameter"),
    (CHAT, chat(audio={"voice": "alloy"}), "audio", "unsupported_parameter"),
    (CHAT, chat(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
    (CHAT, chat(prediction={"type": "text", "content": "x"}), "prediction.type", "invalid_value"),
    (CHAT, chat(prediction={"type": "content", "content": 5}), "prediction.content", "invalid_value"),
    (CHAT, chat(prediction={"type": "content", "content": "x", "extra": 1}), "prediction.extra", "invalid_value"),
    (CHAT, chat(verbosity="low"), "verbosity", "unsupported_parameter"),
    (CHAT, chat(store="yes"), "store", "invalid_value"),
    (CHAT, chat(reasoning_effort="high"), "reasoning_effort", "unsupported_parameter"),
    (CHAT, chat(reasoning_effort="hard"), "reasoning_effort", "invalid_value"),
    (RESPONSES, {"model": "tiny", "input": "x", "reasoning": {"effort": "low"}}, "reasoning.effort",
     "unsupported_parameter"),
    (RESPONSES, {"model": "tiny", "input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary",
     "unsupported_parameter"),
    (RESPONSES, {"model": "tiny", "input": "x", "text": {"verbosity": "high"}}, "text.verbosity",
     "unsupported_parameter"),
    # the extensions that constrain the output, read before any model is involved
    (CHAT, chat(min_tokens=3), "min_tokens", "invalid_value"),
    (CHAT, chat(min_tokens=-1), "min_tokens", "invalid_value"),
    (CHAT, chat(return_token_ids="y"), "return_token_ids", "invalid_value"),
    (CHAT, chat(guided_choice=[]), "guided_choice", "invalid_value"),
    (CHAT, chat(guided_choice=["a", 1]), "guided_choice", "invalid_value"),
    (CHAT, chat(guided_regex=""), "guided_regex", "invalid_value"),
    (CHAT, chat(grammar="x" * 70_000), "grammar", "schema_too_complex"),
    (CHAT, chat(json_schema="{not json"), "json_schema", "invalid_schema"),
    (CHAT, chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs.choice", "invalid_value"),
    (CHAT, chat(structured_outputs={"pattern": "a"}), "structured_outputs.pattern", "invalid_value"),
    (CHAT, chat(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern",
     "unsupported_parameter"),
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "invalid_value"),
    (COMPLETIONS, completion(regex="a", ebnf='root ::= "a"'), "ebnf", "invalid_value"),
    (CHAT, chat(tools=[TOOL], guided_choice=["a"]), "guided_choice", "unsupported_parameter"),
]


#: refused once the model is known: its engine's limits (n), its vocabulary
#: (token ids), its grammar compiler (schemas)
BAD_FOR_THE_MODEL = [
    (CHAT, chat(n=1000), "n", "invalid_value"),
    (CHAT, chat(logit_bias={"999999": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}),
     "response_format", "invalid_schema"),
    (COMPLETIONS, completion(response_format={"type": "json_object", "schema": {"type": "nonsense"}}),
     "response_format", "invalid_schema"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
     "tools[0].function.parameters", "invalid_schema"),
    (COMPLETIONS, completion(prompt=[1, 10**9]), "prompt", "invalid_value"),
    (CHAT, chat(guided_regex="(unclosed"), "guided_regex", "invalid_schema"),
    (CHAT, chat(structured_outputs={"grammar": "root ::= missing"}), "structured_outputs.grammar",
     "invalid_schema"),
]


def refusal(route: str, body: dict) -> LockgateError | None:
    """What refuses `body` before any model is involved: the typed parse and
    the built-in validation policy (`lockgate.plugins.validate`)."""
    try:
        if route == RESPONSES:
            typed = parse_responses_request(body, request_id="t")
        else:
            typed = parse_request(CHAT_ENDPOINT if route == CHAT else COMPLETIONS_ENDPOINT, body, request_id="t")
        check_size(typed)
    except LockgateError as exc:
        return exc
    return None


@pytest.mark.parametrize("route, body, param, code", BAD)
def test_each_refusal_is_read_without_a_model(route, body, param, code):
    error = refusal(route, body)
    assert error is not None, "not refused"
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error", param, code)


@pytest.mark.parametrize("route, body", [(route, body) for route, body, _, _ in BAD_FOR_THE_MODEL])
def test_what_only_the_model_refuses_parses(route, body):
    assert refusal(route, body) is None


# over HTTP: what only the model refuses, and one row of the table read
# without it (the same parse, behind the same handler)
@pytest.mark.parametrize("route, body, param, code", [*BAD_FOR_THE_MODEL, BAD[0], BAD[-1]])
async def test_invalid_parameters_are_400_with_param(tiny_model, make_client, route, body, param, code):
    client = await make_client(tiny_model)
    response = await client.post(route, json=body)
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code


GOOD = [
    (CHAT, chat(temperature=0, top_p=1, n=2, seed=-5, stop=["a", "b"], presence_penalty=-2,
                frequency_penalty=2, logit_bias={"5": -100, "6": 100}, logprobs=False,
                user="me", max_completion_tokens=3)),
    # fields accepted without effect, and refused ones at the values that ask for nothing
    (CHAT, chat(store=False, metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p", safety_identifier="s",
                typical_p=1, mirostat=0, modalities=["text"], audio=None, verbosity="medium", echo=False,
                reasoning_effort="none")),
    (CHAT, chat(min_tokens=1, return_token_ids=True, structured_outputs={"regex": "[a-z]+",
                                                                       "disable_any_whitespace": True})),
    (CHAT, chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "y", "tool_call_id": "1"},
        {"role": "developer", "content": "d"}, {"role": "user", "content": "z"}])),
    # a call without arguments as some clients send it back, with the SDK's null fields
    (CHAT, chat(messages=[{"role": "user", "content": "t?"}, {"role": "assistant", "content": None, "refusal": None,
        "audio": None, "function_call": None, "annotations": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "1"}])),
    (CHAT, chat(tools=[TOOL], tool_choice="none")),
    (CHAT, chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})),
    (CHAT, chat(functions=[TOOL["function"]], function_call={"name": "f"})),
    (CHAT, chat(stream=True, stream_options={"include_usage": False}, response_format={"type": "text"})),
    (CHAT, chat(response_format={"type": "json_object"})),
    (CHAT, chat(max_tokens=None, temperature=None)),
    (COMPLETIONS, completion(prompt=["a", "b"], stop="x", best_of=1)),
    (COMPLETIONS, completion(prompt=[[5, 6], [7]])),
    (COMPLETIONS, completion(top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True,
                             stop_token_ids=[2])),
]


@pytest.mark.parametrize("route, body", GOOD)
async def test_valid_parameters_are_accepted(tiny_model, make_client, route, body):
    client = await make_client(tiny_model)
    response = await client.post(route, json=body)
    assert response.status == 200, await response.text()
