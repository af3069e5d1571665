"""The peers' tool-calling suites, ported: vLLM's function-calling tests
(`tests/entrypoints/openai/.../test_completion_with_function_calling.py`,
`tests/tool_use/`) and llama.cpp's server tool-call tests
(`tools/server/tests/unit/test_tool_call.py`), the cases that check the
server rather than what a particular model chooses to say, against the
default model through the openai SDK. Also the clients people write tools
with: `openai.pydantic_function_tool` of nested models (chat and
Responses), LangChain's `bind_tools` and the OpenAI Agents SDK."""

from __future__ import annotations

import json

import agents
import jsonschema
import openai
import pydantic
import pytest
from langchain_openai import ChatOpenAI

pytestmark = pytest.mark.default_model

# vLLM's weather tools: the first points into its own `$defs`, and carries
# `strict` inside its parameters (not a JSON Schema keyword: an annotation)
WEATHER_OPTIONS = {
    "title": "WeatherOptions", "type": "object", "additionalProperties": False,
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius",
                 "description": "Temperature unit", "title": "Temperature Unit"},
        "include_forecast": {"type": "boolean", "default": False,
                             "description": "Whether to include a 24-hour forecast", "title": "Include Forecast"},
        "language": {"type": "string", "default": "zh-CN", "description": "Language of the response",
                     "title": "Language", "enum": ["zh-CN", "en-US", "ja-JP"]},
    },
}
VLLM_TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object", "strict": True,
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for, e.g. 'Vienna'",
                         "default": "Vienna"},
                "country": {"type": "string", "description": "The country that the city is in, e.g. 'Austria'"},
                "unit": {"type": "string", "description": "The unit to fetch the temperature in",
                         "enum": ["celsius", "fahrenheit"]},
                "options": {"$ref": "#/$defs/WeatherOptions", "description": "Optional parameters for weather query"},
            },
            "required": ["country", "unit"],
            "$defs": {"WeatherOptions": WEATHER_OPTIONS},
        }}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast for a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to get the forecast for, e.g. 'Vienna'",
                         "default": "Vienna"},
                "country": {"type": "string", "description": "The country that the city is in, e.g. 'Austria'"},
                "days": {"type": "integer", "description": "Number of days to get the forecast for (1-7)"},
                "unit": {"type": "string", "description": "The unit to fetch the temperature in",
                         "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["country", "days", "unit"],
        }}},
]
VLLM_MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "Can you tell me what the current weather is in Berlin and the forecast for the "
                                "next 5 days, in fahrenheit?"},
]
SAMPLE_SCHEMA = {  # vLLM's sample_json_schema
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
        "work_history": {"type": "array", "items": {
            "type": "object",
            "properties": {"company": {"type": "string"}, "duration": {"type": "number"},
                           "position": {"type": "string"}},
            "required": ["company", "position"]}},
    },
    "required": ["name", "age", "skills", "work_history"],
}
# llama.cpp's tools
TEST_TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}}, "required": ["success"]}}}
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Runs code in an ipython interpreter and returns the result of the execution after 60 seconds.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string",
                   "description": "The code to run in the ipython interpreter."}}, "required": ["code"]}}}
CODING = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": "Write an example"}]

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [*VLLM_TOOLS, TEST_TOOL, PYTHON_TOOL]}


@pytest.fixture
async def client(default_model, make_openai):
    return await make_openai(default_model)


async def ask(client, *, stream: bool, **kwargs):
    """One chat request, streamed or not, as the message it amounts to: the
    streamed one reassembled with the checks vLLM's and llama.cpp's stream
    readers make on the way (one choice, role only `assistant`, no empty
    content deltas but OpenAI's opening one, each call's id, type and whole
    name in its first delta, one finish reason)."""
    if not stream:
        reply = await client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        return choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    content, calls, finish_reasons = None, {}, []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert choice.delta.role in (None, "assistant")
        if choice.delta.content is not None:
            # "" only in the opening chunk with the role, as OpenAI sends it
            assert choice.delta.content != "" or choice.delta.role == "assistant"
            if choice.delta.content:
                content = (content or "") + choice.delta.content
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert not delta.function.name  # the name comes once, whole
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        if choice.finish_reason is not None:
            finish_reasons.append(choice.finish_reason)
    assert len(finish_reasons) == 1
    as_calls = [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())]
    return content, as_calls, finish_reasons[0]


def assert_calls_valid(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and len(call.id) >= 9
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ------------------------------------------------------------------ vLLM


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}])
async def test_vllm_function_tool_use(client, stream, tool_choice):
    content, calls, finish = await ask(client, stream=stream, model="smollm2", messages=VLLM_MESSAGES,
                                       tools=VLLM_TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    names = ["get_current_weather"] if isinstance(tool_choice, dict) else None
    assert finish == "tool_calls" and not content
    assert_calls_valid(calls, names)


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_named_tool_use(client, stream):
    # greedy, the 135M model repeats list items until max_tokens; a penalty
    # on repeats lets it close the unbounded arrays, as users run such models
    content, calls, finish = await ask(
        client, stream=stream, model="smollm2",
        messages=[{"role": "system", "content": "you are a helpful assistant"},
                  {"role": "user", "content": "Give an example JSON for an employee profile using the specified tool."}],
        tools=[{"type": "function", "function": {"name": "dummy_function_name", "description": "This is a dummy function",
                                                  "parameters": SAMPLE_SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "dummy_function_name"}},
        max_completion_tokens=1000, temperature=0, frequency_penalty=1.0,
    )
    assert finish == "tool_calls" and not content and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), SAMPLE_SCHEMA)


@pytest.mark.parametrize("kwargs, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "dummy_function_name"}}), "tool_choice"),
    (dict(tools=[TEST_TOOL], tool_choice={"type": "function", "function": {"name": "nondefined_function_name"}}),
     "tool_choice"),
    (dict(tools=[TEST_TOOL], tool_choice={}), "tool_choice"),
])
async def test_vllm_inconsistent_tool_choice_and_tools(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="smollm2", messages=CODING, max_completion_tokens=1000, **kwargs)
    assert refused.value.body["param"] == param and refused.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}])
async def test_vllm_max_tokens_with_tool_choice_required(client, tool_choice):
    reply = await client.chat.completions.create(model="smollm2", messages=VLLM_MESSAGES, tools=VLLM_TOOLS,
                                                 tool_choice=tool_choice, temperature=0, max_completion_tokens=1)
    # no half-written call, and no envelope text in its place
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.tool_calls is None and not reply.choices[0].message.content


async def test_vllm_structured_outputs_tool_calling(client):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}}
    reply = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in San Francisco in celsius? "
                                                               "Use the get_weather tool."}],
        tools=[tool], tool_choice="required", temperature=0, max_completion_tokens=128)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call, *_] = [c for c in choice.message.tool_calls if c.function.name == "get_weather"]
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str) and arguments["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("arguments", ["{}", ""])
async def test_vllm_no_args_tool_call_history(client, arguments):
    # the SDK's whole message sent back (its null fields too), arguments "" or "{}"
    history = [
        {"role": "system", "content": "You are a helpful assistant. Always use the available tools when relevant, "
                                      "and reply with a short sentence after receiving a tool result."},
        {"role": "user", "content": "What time is it now?"},
        {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
         "annotations": None, "tool_calls": [{"id": "call_0123456789", "type": "function",
                                              "function": {"name": "get_current_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_0123456789", "content": "2026-12-01T15:00:00"},
    ]
    reply = await client.chat.completions.create(model="smollm2", messages=history, temperature=0, seed=42,
                                                 max_completion_tokens=128)
    assert reply.choices[0].message.content.strip()


@pytest.mark.parametrize("tools", [None, VLLM_TOOLS[:1]])
async def test_vllm_chat_completion_streamed_equals_whole(client, tools):
    messages = [{"role": "user", "content": "Hi! How are you?"},
                {"role": "assistant", "content": "I'm doing great! How can I assist you?"},
                {"role": "user", "content": "Can you tell me a joke please?"}]
    extra = {"tools": tools} if tools else {}
    whole = await ask(client, stream=False, model="smollm2", messages=messages, temperature=0,
                      max_completion_tokens=150, **extra)
    streamed = await ask(client, stream=True, model="smollm2", messages=messages, temperature=0,
                         max_completion_tokens=150, **extra)
    assert streamed[0] == whole[0] and streamed[2] == whole[2]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed[1]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole[1]]
    if not tools:
        assert whole[0] and not whole[1] and whole[2] != "tool_calls"


async def test_vllm_tool_call_with_results_history(client):
    # assistant turns with tool_calls and no `content` key at all, then results
    history = [
        {"role": "user", "content": "What is the weather in Dallas, Texas and Orlando, Florida in Fahrenheit?"},
        {"role": "assistant", "tool_calls": [
            {"id": "chatcmpl-tool-03e6481b146e408e9523d9c956696295", "type": "function", "function": {
                "name": "get_current_weather", "arguments": '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}'}},
            {"id": "chatcmpl-tool-d027061e1bd21cda48bee7da829c1f5b", "type": "function", "function": {
                "name": "get_current_weather", "arguments": '{"city": "Orlando", "state": "Fl", "unit": "fahrenheit"}'}},
        ]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-03e6481b146e408e9523d9c956696295",
         "content": "The weather in Dallas TX is 98 degrees fahrenheit with mostly cloudy skies."},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-d027061e1bd21cda48bee7da829c1f5b",
         "content": "The weather in Orlando FL is 78 degrees fahrenheit with clear skies."},
    ]
    for stream in (False, True):
        content, calls, finish = await ask(client, stream=stream, model="smollm2", messages=history,
                                           tools=VLLM_TOOLS, tool_choice="none", temperature=0, max_tokens=60)
        assert content and not calls and finish != "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_parallel_tool_calls_stream_by_index(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Dallas, Texas and Orlando, Florida in Fahrenheit?"}]
    kwargs = dict(model="smollm2", messages=messages, tools=VLLM_TOOLS, tool_choice="required", temperature=0,
                  max_tokens=200)
    _, whole, _ = await ask(client, stream=False, **kwargs)
    content, calls, finish = await ask(client, stream=stream, **kwargs)
    assert finish == "tool_calls" and not content
    assert_calls_valid(calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert len({c.id for c in calls}) == len(calls)


# ------------------------------------------------------------------ llama.cpp


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool, key", [(TEST_TOOL, "success"), (PYTHON_TOOL, "code")])
async def test_llama_cpp_completion_with_required_tool(client, stream, tool, key):
    content, calls, finish = await ask(client, stream=stream, model="smollm2", messages=CODING, tools=[tool],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=512,
                                       temperature=0.0, top_p=1.0, extra_body={"top_k": 1})
    assert len(calls) == 1 and not content and finish == "tool_calls"
    assert calls[0].function.name == tool["function"]["name"] and calls[0].id
    arguments = json.loads(calls[0].function.arguments)
    assert key in arguments
    if tool is TEST_TOOL:
        assert arguments == {"success": True}  # `const` is enforced


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools, tool_choice", [(None, None), ([PYTHON_TOOL], "none")])
async def test_llama_cpp_completion_without_tool_call(client, default_model, stream, tools, tool_choice):
    # explicit JSON nulls, as llama.cpp's test sends them
    body = {"tools": tools, "tool_choice": tool_choice}
    _, calls, finish = await ask(client, stream=stream, model="smollm2", max_tokens=128, extra_body=body,
                                 messages=[{"role": "system", "content": "You are a coding assistant."},
                                           {"role": "user", "content": "say hello world with python"}])
    assert not calls and finish != "tool_calls"


async def test_llama_cpp_malformed_tool_call_args_rejected(client):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="smollm2", max_tokens=128, messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_123", "type": "function", "function": {"name": "test", "arguments": "{"}}]},
            {"role": "user", "content": "Continue"}])
    assert refused.value.body["type"] == "invalid_request_error"
    assert refused.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


async def test_llama_cpp_calc_result_history(client):
    # content null beside tool_calls, and a tool message carrying a name
    reply = await client.chat.completions.create(model="smollm2", max_tokens=40, temperature=0, messages=[
        {"role": "system", "content": "You are a tools-calling assistant. You express numerical values with at most "
                                      "two decimals."},
        {"role": "user", "content": "What's the y coordinate of a point on the unit sphere at angle 30 degrees?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_6789", "type": "function", "function": {
            "name": "calculate", "arguments": "{\"expression\":\"sin(30 * pi / 180)\"}"}}]},
        {"role": "tool", "name": "calculate", "content": "0.55644242476", "tool_call_id": "call_6789"}],
        tools=[{"type": "function", "function": {
            "name": "calculate", "description": "A calculator function that computes values of arithmetic expressions",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}}])
    message = reply.choices[0].message
    assert message.content or message.tool_calls


# ------------------------------------------------------------------ the clients tools are written with


class Country(pydantic.BaseModel):
    name: str
    code: str


class Address(pydantic.BaseModel):
    street: str
    country: Country


class Person(pydantic.BaseModel):
    """Record a person."""

    name: str
    address: Address


PERSON_PROMPT = "Ada Lovelace lives at 12 Main St in the United Kingdom (GB)."


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
async def test_pydantic_function_tool_nested_two_levels(client, tool_choice):
    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]  # what made these a 400
    reply = await client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": PERSON_PROMPT}], tools=[tool],
        tool_choice=tool_choice, max_tokens=200, temperature=0)
    message = reply.choices[0].message
    if tool_choice == "required" or message.tool_calls:
        assert all(isinstance(c.function.parsed_arguments, Person) for c in message.tool_calls)
    else:
        assert message.content


@pytest.mark.parametrize("stream", [False, True])
async def test_deprecated_functions_with_defs(client, stream):
    function = openai.pydantic_function_tool(Person)["function"]
    _, calls, finish = await ask(client, stream=stream, model="smollm2", max_tokens=200, temperature=0,
                                 messages=[{"role": "user", "content": PERSON_PROMPT}],
                                 extra_body={"functions": [function], "function_call": {"name": "Person"}})
    assert finish == "tool_calls" and calls
    Person.model_validate_json(calls[0].function.arguments)


async def test_pydantic_tool_on_the_responses_api(client):
    schema = openai.pydantic_function_tool(Person)["function"]["parameters"]
    response = await client.responses.create(
        model="smollm2", input=PERSON_PROMPT, tool_choice="required", max_output_tokens=200, temperature=0,
        tools=[{"type": "function", "name": "Person", "parameters": schema, "strict": True},
               {"type": "function", "name": "Other", "strict": False, "parameters": {
                   "type": "object", "properties": {"where": {"$ref": "#/$defs/Address"}},
                   "$defs": {"Address": {"type": "string"}}}}])
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    for call in calls:
        if call.name == "Person":
            Person.model_validate_json(call.arguments)
        else:
            assert isinstance(json.loads(call.arguments).get("where", ""), str)


async def test_responses_tool_schema_errors_name_the_tool(client):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="smollm2", input="x", tools=[
            {"type": "function", "name": "ok", "parameters": {"type": "object"}},
            {"type": "function", "name": "f", "strict": True,
             "parameters": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}])
    assert refused.value.body["param"] == "tools[1].parameters"
    assert "'uniqueItems'" in refused.value.body["message"]


async def test_response_format_refs_resolve_in_chat_and_responses(client):
    schema = Person.model_json_schema()
    reply = await client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": PERSON_PROMPT}],
                                                response_format=Person, max_tokens=200, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Person)
    response = await client.responses.create(
        model="smollm2", input=PERSON_PROMPT, max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "Person", "schema": schema}})
    Person.model_validate_json(response.output_text)


async def test_agents_sdk_function_tool_with_a_nested_model(default_model, make_client):
    recorded = []

    @agents.function_tool
    def record(person: Person) -> str:
        """Record a person."""
        recorded.append(person)
        return "recorded"

    agents.set_tracing_disabled(True)
    http = await make_client(default_model)
    sdk = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)
    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0)
    for model in (agents.OpenAIChatCompletionsModel("smollm2", sdk), agents.OpenAIResponsesModel("smollm2", sdk)):
        agent = agents.Agent(name="clerk", instructions="Record people.", tools=[record], model=model,
                             model_settings=settings, tool_use_behavior="stop_on_first_tool")
        result = await agents.Runner.run(agent, PERSON_PROMPT)
        assert result.final_output == "recorded"
    assert recorded and all(isinstance(p, Person) for p in recorded)
    await sdk.close()


async def test_langchain_bind_tools_with_a_nested_model(default_model, make_client):
    http = await make_client(default_model)
    llm = ChatOpenAI(base_url=str(http.make_url("/v1")), api_key="x", model="smollm2", temperature=0,
                     max_retries=0, max_tokens=200)
    message = await llm.bind_tools([Person], tool_choice="required").ainvoke(PERSON_PROMPT)
    assert message.tool_calls and message.tool_calls[0]["name"] == "Person"
    for call in message.tool_calls:
        Person.model_validate(call["args"])
