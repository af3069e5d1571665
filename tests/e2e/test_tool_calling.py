"""Tool calling through the openai SDK: on the default model (whose template
knows no tools: the `generic` format), and a third-party format on the tiny
model."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from lockgate import hookimpl
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.tool_calls import ParsedOutput, ToolCall, ToolCallFormat, lark_json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOLS = [WEATHER, CALCULATOR]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_valid(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture
async def client(default_model, make_openai):
    return await make_openai(default_model)


@pytest.mark.default_model
async def test_required_returns_calls_that_validate(client):
    reply = await client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid(choice.message.tool_calls)


@pytest.mark.default_model
async def test_a_named_tool_is_the_one_called(client):
    reply = await client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "calculate"}},
    )
    calls = reply.choices[0].message.tool_calls
    assert_valid(calls)
    assert {c.function.name for c in calls} == {"calculate"}


@pytest.mark.default_model
async def test_none_is_plain_chat(client):
    reply = await client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content
    plain = await client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30, temperature=0)
    assert message.content == plain.choices[0].message.content


@pytest.mark.default_model
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_auto_answers_with_calls_or_text_always_well_formed(client, seed):
    reply = await client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=seed
    )
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert_valid(choice.message.tool_calls)
    else:
        assert choice.message.content and not choice.message.content.lstrip().startswith("{")


@pytest.mark.default_model
@pytest.mark.parametrize("parallel", [True, False])
async def test_streaming_reassembles_to_the_same_calls(client, parallel):
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                  temperature=1.0, seed=11, parallel_tool_calls=parallel)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    stream = await client.chat.completions.create(**kwargs, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or ():
                if part.id is not None:  # the first chunk of a call
                    assert part.type == "function" and part.function.name
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                calls[part.index]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    if not parallel:
        assert len(expected) == 1


@pytest.mark.default_model
async def test_a_call_then_its_result_then_an_answer(client):
    messages = list(ASK)
    first = await client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    answer = await client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=40, temperature=0
    )
    content = answer.choices[0].message.content
    assert content and answer.choices[0].finish_reason == "stop"
    # the answer was written as the format's envelope, and read back as text
    assert not content.lstrip().startswith("{") and answer.choices[0].message.tool_calls is None
    # a tool message must answer a call the conversation made
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="smollm2", messages=[*ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}],
            max_tokens=5,
        )
    assert refused.value.body["param"] == "messages[1].tool_call_id"


class Weather(pydantic.BaseModel):
    city: str
    days: int


@pytest.mark.default_model
async def test_the_sdk_pydantic_helpers_work_unchanged(client):
    reply = await client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Forecast for Oslo, 3 days"}],
        tools=[openai.pydantic_function_tool(Weather)], tool_choice="required", max_tokens=60, temperature=0,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)


@pytest.mark.default_model
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_tool_requests_are_400s_before_the_engine(client, default_model, stream):
    before = default_model.engine.stats()
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}]),
         "tools[0].function.parameters"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            out = await client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, stream=stream,
                                                       **kwargs)
            async for _ in out:
                pass
        assert refused.value.body["param"] == param
    assert default_model.engine.stats().requests_waiting == before.requests_waiting


# ------------------------------------------------------------------ a format from a plugin


class FunctionTags(ToolCallFormat):
    """`<function=NAME>{...}</function>`: the README's example format."""

    name = "function-tags"
    CALL = re.compile(r"<function=([\w-]+)>(.*?)</function>", re.S)

    @classmethod
    def fits(cls, chat_template):
        return "<function=" in (chat_template or "")

    def instructions(self, tools):
        listed = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
        return f"Tools:\n{listed}\nCall one as <function=NAME>{{arguments}}</function>."

    def render_calls(self, calls):
        return "".join(f"<function={c.name}>{c.arguments}</function>" for c in calls)

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        call = " | ".join(f'"<function={t.name}>" {lark_json(t.parameters)} "</function>"' for t in tools)
        return f"start: call{{1,{max_calls}}}\ncall: {call}"

    def parse(self, text):
        calls = [ToolCall(name, args) for name, args in self.CALL.findall(text)]
        return ParsedOutput(self.CALL.sub("", text).strip() or None, calls)

    def start_markers(self):
        return ("<function=",)


class FunctionTagsPlugin:
    @hookimpl
    def lockgate_register_tool_call_formats(self, register):
        register(FunctionTags)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_plugin_format_is_chosen_and_forces_its_calls(load_tiny, make_openai, stream):
    pm = get_plugin_manager(autoload=False, plugins=[FunctionTagsPlugin()])
    model = load_tiny(pm=pm, tool_call_format="function-tags")
    assert isinstance(model.tool_call_format, FunctionTags)
    client = await make_openai(model)
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        calls, names = {}, {}
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            for part in chunk.choices[0].delta.tool_calls or ():
                names.setdefault(part.index, part.function.name)
                calls[part.index] = calls.get(part.index, "") + (part.function.arguments or "")
        calls = [(names[i], calls[i]) for i in sorted(calls)]
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_an_unknown_format_name_stops_start_up(load_tiny):
    from lockgate.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="no tool-call format named 'nope'; registered: .*generic"):
        load_tiny(tool_call_format="nope")


def test_the_default_model_gets_the_generic_format(default_model):
    assert default_model.tool_call_format.name == "generic"


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "\nCall them as <tool_call>{json}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_renders_tools_gets_them_and_its_format(load_tiny):
    from lockgate.plugin_api.request import CHAT_ENDPOINT, parse_request

    model = load_tiny(chat_template=HERMES_TEMPLATE)
    assert model.tool_call_format.name == "hermes"
    pm = get_plugin_manager(autoload=False)
    body = {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}], "tools": TOOLS}
    prompt = pm.hook.lockgate_render_prompt(request=parse_request(CHAT_ENDPOINT, body, request_id="t"), model=model)
    assert "Tools: get_weather calculate" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    # with tool_choice none the template renders no tools, but still the history
    body["tool_choice"] = "none"
    prompt = pm.hook.lockgate_render_prompt(request=parse_request(CHAT_ENDPOINT, body, request_id="t"), model=model)
    assert "Tools:" not in prompt and "<tool_call>" in prompt
