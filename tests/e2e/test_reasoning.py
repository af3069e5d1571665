"""Reasoning output: a model's thinking told from its answer, whole and
streamed (split at every position), chosen from the chat template, and
served as chat's `reasoning_content`, Responses' `reasoning` items and
Messages' `thinking` blocks. The server runs a scripted executor: the tiny
model's real tokenizer and templates, an output known to the byte."""

from __future__ import annotations

import json

import anthropic
import pytest

from llama_cpp_reference import reference_models_dir
from lockgate.models import load_model
from lockgate.engine.executor import ExecutorOptions
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.output import OutputParser
from lockgate import hookimpl
from lockgate.plugin_api.reasoning import ReasoningFormat, choose_reasoning_format
from lockgate.plugins.reasoning_formats import BUILT_IN_FORMATS, DeepSeekR1Format, Qwen3Format
from lockgate.plugins.tool_formats.json_formats import HermesFormat
from scripted_executor import ScriptedExecutors, set_script
from tiny_model import write_tiny_gguf

THOUGHT = "The user greets me.\nI should greet back."
ANSWER = "Hello! How can I help?"
SCRIPT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
MESSAGES = [{"role": "user", "content": "hi"}]


def template(name: str) -> str:
    return (reference_models_dir() / "templates" / name).read_text()


def split_everywhere(text: str):
    """`text` cut into two pieces at every position, then into single characters."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


def streamed(parser: OutputParser, pieces):
    reader = parser.stream()
    reasoning = content = ""
    for piece in pieces:
        split = reader.feed(piece)
        reasoning, content = reasoning + split.reasoning, content + split.content
    rest, output = reader.finish()
    return reasoning + rest.reasoning, content + rest.content, output


def parser(fmt=Qwen3Format(), *, opened=False, tools=None) -> OutputParser:
    return OutputParser(fmt, opened, tools, count_tokens=len)


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("text, opened, thought, answer", [
    (SCRIPT, False, THOUGHT, ANSWER),
    (f"  <think>{THOUGHT}</think>{ANSWER}", False, THOUGHT, ANSWER),
    (f"\n{THOUGHT}\n</think>\n\n{ANSWER}", True, THOUGHT, ANSWER),  # the prompt opened it
    (SCRIPT, True, THOUGHT, ANSWER),  # ... and the model wrote the tag again
    (ANSWER, False, None, ANSWER),  # no thinking
    (f"{ANSWER} <think>x</think>", False, None, f"{ANSWER} <think>x</think>"),  # tags mid-answer are text
    (f"<think>\n{THOUGHT}", False, THOUGHT, ""),  # cut short inside the thinking
    (f"{THOUGHT}  ", True, THOUGHT, ""),
    ("<think></think>" + ANSWER, False, None, ANSWER),  # an empty thinking
    ("<thin", False, None, "<thin"),  # a start of the tag that never completes is text
    ("<think>a </thi", False, "a </thi", ""),  # ... or thinking
    ("", False, None, ""),
])
def test_thinking_is_told_from_the_answer_however_the_text_is_cut(text, opened, thought, answer):
    whole = parser(opened=opened).parse(text)
    assert (whole.reasoning, whole.content) == (thought, answer)
    for pieces in split_everywhere(text):
        reasoning, content, output = streamed(parser(opened=opened), pieces)
        assert (reasoning or None, content) == (thought, answer), pieces
        assert (output.reasoning, output.content, output.reasoning_tokens) == (
            whole.reasoning, whole.content, whole.reasoning_tokens)


def test_a_tool_call_after_the_thinking_parses_as_before():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>\nI need the weather.\n</think>\n\n{call}"
    whole = parser(tools=HermesFormat()).parse(text)
    assert whole.reasoning == "I need the weather."
    assert whole.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Paris"})]
    for pieces in split_everywhere(text):
        reasoning, content, output = streamed(parser(tools=HermesFormat()), pieces)
        assert (reasoning, content.strip()) == ("I need the weather.", ""), pieces
        assert [(c.name, c.arguments) for c in output.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_no_format_leaves_the_thinking_in_the_answer():
    whole = OutputParser(None, False, None, count_tokens=len).parse(SCRIPT)
    assert (whole.reasoning, whole.content) == (None, SCRIPT)


def test_the_thinking_tokens_are_counted_with_their_tags():
    assert parser().parse(SCRIPT).reasoning_tokens == len(f"<think>{THOUGHT}</think>")
    assert parser(opened=True).parse(f"{THOUGHT}</think>ok").reasoning_tokens == len(f"{THOUGHT}</think>")
    assert parser().parse(ANSWER).reasoning_tokens == 0


# ---------------------------------------------------------------- choosing


@pytest.mark.parametrize("name, expected", [
    ("Qwen-Qwen3-0.6B.jinja", "qwen3"),
    ("Qwen-QwQ-32B.jinja", "qwen3"),
    ("Qwen3.5-4B.jinja", "qwen3"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_r1"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek_r1"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_r1"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", None),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", None),
])
def test_the_format_follows_from_the_chat_template(name, expected):
    chosen = choose_reasoning_format(list(BUILT_IN_FORMATS.values()), None, template(name))
    assert (chosen.name if chosen else None) == expected
    assert choose_reasoning_format(list(BUILT_IN_FORMATS.values()), "none", template(name)) is None


def test_an_unknown_format_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        choose_reasoning_format(list(BUILT_IN_FORMATS.values()), "o1", None)


@pytest.mark.parametrize("tail, fmt, opened", [
    ("<|im_start|>assistant\n", Qwen3Format(), False),
    ("<|im_start|>assistant\n<think>\n", Qwen3Format(), True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", Qwen3Format(), False),  # enable_thinking: false
    ("<｜Assistant｜>", DeepSeekR1Format(), True),  # R1 always thinks
    ("<｜Assistant｜></think>", DeepSeekR1Format(), False),  # V3.1 with thinking off
])
def test_whether_the_prompt_opened_the_thinking(tail, fmt, opened):
    assert fmt.opened_by(tail) is opened


# ---------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def load_scripted(tmp_path_factory):
    """The tiny model's tokenizer with a chat template, its output scripted,
    and a context of 4096 tokens (room for Anthropic's least thinking budget)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("scripted") / "tiny.gguf", context_length=4096)
    loaded = []

    def load(chat_template: str):
        model = load_model(get_plugin_manager(autoload=False, plugins=[ScriptedExecutors()]), str(path),
                           executor="scripted", served_name="tiny", chat_template=chat_template,
                           executor_options=ExecutorOptions.of(max_num_seqs=8, max_total_tokens=8192,
                                                            prefill_chunk_size=256))
        loaded.append(model)
        return model

    yield load
    for model in loaded:
        model.engine.shutdown()


@pytest.fixture(scope="module")
def qwen3(load_scripted):
    """Qwen3's template: a reasoning format, `qwen3`, and a tool-call format, `hermes`."""
    return load_scripted(template("Qwen-Qwen3-0.6B.jinja"))


@pytest.fixture(scope="module")
def r1(load_scripted):
    """DeepSeek-R1's, whose prompt opens the thinking."""
    return load_scripted(template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))


def test_the_formats_are_chosen(qwen3, r1):
    assert (qwen3.reasoning_format.name, qwen3.tool_call_format.name) == ("qwen3", "hermes")
    assert r1.reasoning_format.name == "deepseek_r1"


async def chat_stream(client, body):
    response = await client.post("/v1/chat/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    assert response.status == 200, await response.text()
    chunks = []
    async for line in response.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def joined(chunks, field):
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("model_name, script", [("qwen3", SCRIPT), ("r1", f"{THOUGHT}\n</think>\n\n{ANSWER}")])
async def test_chat_answers_carry_reasoning_content_whole_and_streamed(request, make_client, model_name, script):
    model = request.getfixturevalue(model_name)
    set_script(model, script)
    client = await make_client(model)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 100, "temperature": 0}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    whole = await response.json()
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert whole["choices"][0]["finish_reason"] == "stop"
    reasoning_tokens = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens < whole["usage"]["completion_tokens"]
    chunks = await chat_stream(client, body)
    # no tag leaks, field for field the same
    assert (joined(chunks, "reasoning_content"), joined(chunks, "content")) == (THOUGHT, ANSWER)
    streamed_usage = chunks[-1]["usage"]
    for key in ("completion_tokens", "completion_tokens_details"):  # the prompt's KV is cached by now
        assert streamed_usage[key] == whole["usage"][key]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    # the thinking goes out as it comes: several chunks of it, all before the answer
    kinds = [next(iter(c["choices"][0]["delta"].keys() & {"reasoning_content", "content"}), None)
             for c in chunks if c["choices"] and c["choices"][0]["delta"]]
    assert kinds.count("reasoning_content") > 3
    assert "reasoning_content" not in kinds[kinds.index("content", 1):]


async def test_an_unclosed_thinking_at_max_tokens_is_reasoning_cut_short(qwen3, make_client):
    set_script(qwen3, SCRIPT)
    client = await make_client(qwen3)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    whole = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""
    assert THOUGHT.startswith(choice["message"]["reasoning_content"]) and choice["message"]["reasoning_content"]
    chunks = await chat_stream(client, body)
    assert joined(chunks, "reasoning_content") == choice["message"]["reasoning_content"]
    assert joined(chunks, "content") == ""


async def test_enable_thinking_reaches_the_template(qwen3, make_client):
    set_script(qwen3, ANSWER)
    client = await make_client(qwen3)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 50,
            "chat_template_kwargs": {"enable_thinking": False}}
    prompt = await client.post("/tokenize", json=body)
    text = (await (await client.post("/detokenize", json={"tokens": (await prompt.json())["tokens"]})).json())
    assert text["prompt"].endswith("<think>\n\n</think>\n\n")
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, ANSWER)


async def prompt_text(client, body) -> str:
    tokens = (await (await client.post("/tokenize", json=body)).json())["tokens"]
    return (await (await client.post("/detokenize", json={"tokens": tokens})).json())["prompt"]


async def test_reasoning_effort_is_the_thinking_switch(qwen3, make_client):
    """OpenAI's `reasoning_effort` (Responses: `reasoning.effort`): `none`
    closes the thinking in the prompt as `enable_thinking: false` does, any
    other effort leaves it open; one that contradicts enable_thinking is a 400."""
    set_script(qwen3, ANSWER)
    client = await make_client(qwen3)
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 50}
    off = await prompt_text(client, {**base, "chat_template_kwargs": {"enable_thinking": False}})
    on = await prompt_text(client, base)
    assert off != on
    assert await prompt_text(client, {**base, "reasoning_effort": "none"}) == off
    assert await prompt_text(client, {**base, "reasoning_effort": "high"}) == on
    message = (await (await client.post("/v1/chat/completions", json={**base, "reasoning_effort": "none"})).json()
               )["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, ANSWER)
    response = await client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 50,
                                                        "reasoning": {"effort": "none"}})
    assert response.status == 200 and (await response.json())["reasoning"]["effort"] == "none"
    clash = await client.post("/v1/chat/completions", json={
        **base, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}})
    assert clash.status == 400 and (await clash.json())["error"]["param"] == "reasoning_effort"


async def test_tool_calls_after_the_thinking(qwen3, make_client):
    set_script(qwen3, '<think>Use it.</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    client = await make_client(qwen3)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": MESSAGES, "tools": tools, "max_tokens": 100}
    whole = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", whole
    assert choice["message"]["reasoning_content"] == "Use it."
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{}]
    chunks = await chat_stream(client, body)
    assert joined(chunks, "reasoning_content") == "Use it."
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "f"
    # required: the grammar lets the thinking run first, then forces the call
    forced = await (await client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})).json()
    assert "choices" in forced, forced
    assert forced["choices"][0]["message"]["reasoning_content"] == "Use it."
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("model_name, script", [
    ("qwen3", '<think>\nJSON it is.\n</think>\n\n{"a": 1}'),
    ("r1", 'JSON it is.\n</think>\n\n{"a": 1}'),
])
async def test_a_response_format_constrains_what_follows_the_thinking(request, make_client, model_name, script):
    model = request.getfixturevalue(model_name)
    set_script(model, script)
    client = await make_client(model)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert (message["reasoning_content"], json.loads(message["content"])) == ("JSON it is.", {"a": 1})


async def test_the_openai_sdk_reads_reasoning_content(qwen3, make_openai):
    set_script(qwen3, SCRIPT)
    sdk = await make_openai(qwen3)
    completion = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100)
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    assert completion.usage.completion_tokens_details.reasoning_tokens > 0
    reasoning = ""
    async for chunk in await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100,
                                                         stream=True):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
    assert reasoning == THOUGHT


async def test_earlier_thinking_reaches_the_template(qwen3, make_client):
    """An assistant turn's `reasoning_content` is the template's to render
    (Qwen3's renders it for turns after the last user message)."""
    set_script(qwen3, ANSWER)
    client = await make_client(qwen3)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    prompt = await (await client.post("/tokenize", json={"model": "tiny", "messages": messages})).json()
    text = (await (await client.post("/detokenize", json={"tokens": prompt["tokens"]})).json())["prompt"]
    assert "<think>\nCall the tool.\n</think>" in text
    bad = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{**messages[1], "reasoning_content": 3}], "max_tokens": 1})
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "messages[0].reasoning_content"


class BracketThink(ReasoningFormat):
    name = "brackets"
    start, end = "[THINK]", "[/THINK]"

    @classmethod
    def fits(cls, chat_template):
        return "[THINK]" in (chat_template or "")


class BracketThinkPlugin:
    @hookimpl
    def lockgate_register_reasoning_formats(self, register):
        register(BracketThink)


#: ChatML that mentions the plugin's tags (and Qwen3's, which a built-in would take)
BRACKET_TEMPLATE = (
    "{# [THINK] ... [/THINK] or <think></think> #}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_plugin_format_is_chosen_before_the_built_ins(tmp_path, make_client, stream):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    pm = get_plugin_manager(autoload=False, plugins=[ScriptedExecutors(), BracketThinkPlugin()])
    model = load_model(pm, str(path), executor="scripted", served_name="tiny", chat_template=BRACKET_TEMPLATE,
                       executor_options=ExecutorOptions.of(max_num_seqs=2, max_total_tokens=1024,
                                                        prefill_chunk_size=256))
    try:
        assert isinstance(model.reasoning_format, BracketThink)
        set_script(model, f"[THINK]{THOUGHT}[/THINK]{ANSWER}")
        client = await make_client(model)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 100}
        if stream:
            chunks = await chat_stream(client, body)
            assert (joined(chunks, "reasoning_content"), joined(chunks, "content")) == (THOUGHT, ANSWER)
        else:
            message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    finally:
        model.engine.shutdown()


# ---------------------------------------------------------------- Responses


async def test_responses_answer_with_a_reasoning_item(qwen3, make_openai):
    set_script(qwen3, SCRIPT)
    sdk = await make_openai(qwen3)
    response = await sdk.responses.create(model="tiny", input="hi", max_output_tokens=100)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT
    assert response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = [event async for event in await sdk.responses.create(model="tiny", input="hi", max_output_tokens=100,
                                                                   stream=True)]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, e.output_index) for i, e in zip(done, [e for e in events if e.type ==
                                                             "response.output_item.done"])] == [
        ("reasoning", 0), ("message", 1)]
    final = events[-1].response
    assert final.output[0].content[0].text == THOUGHT
    assert final.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens
    # the reasoning item goes back as input: the next turn reads it
    follow = await sdk.responses.create(model="tiny", max_output_tokens=5, input=[
        {"role": "user", "content": "hi"}, *[item.model_dump(exclude_none=True) for item in response.output],
        {"role": "user", "content": "and?"}])
    assert follow.status in ("completed", "incomplete")


# ---------------------------------------------------------------- Messages


@pytest.fixture
async def claude(make_client):
    made = []

    async def make(model):
        client = await make_client(model)
        sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="k", max_retries=0)
        made.append(sdk)
        return sdk

    yield make
    for sdk in made:
        await sdk.close()


async def test_messages_answer_with_a_thinking_block(qwen3, claude):
    set_script(qwen3, SCRIPT)
    sdk = await claude(qwen3)
    body = dict(model="tiny", max_tokens=2048, messages=MESSAGES,
                thinking={"type": "enabled", "budget_tokens": 1024})
    message = await sdk.messages.create(**body)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (THOUGHT, ANSWER)
    assert message.stop_reason == "end_turn"
    async with sdk.messages.stream(**body) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
    assert "thinking" in kinds
    # thinking blocks go back in the history as the turn's thinking
    again = await sdk.messages.create(model="tiny", max_tokens=20, messages=[
        *MESSAGES, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": "and?"}])
    assert again.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("thinking, param", [
    ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # not below max_tokens
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
    ("on", "thinking"),
])
async def test_a_bad_thinking_setting_is_a_400_naming_it(qwen3, claude, thinking, param):
    sdk = await claude(qwen3)
    with pytest.raises(anthropic.BadRequestError) as caught:
        await sdk.messages.create(model="tiny", max_tokens=2048, messages=MESSAGES, thinking=thinking)
    assert param in caught.value.message


async def test_thinking_is_refused_by_a_model_that_writes_none(load_scripted, claude):
    sdk = await claude(load_scripted(template("Qwen-Qwen2.5-7B-Instruct.jinja")))
    with pytest.raises(anthropic.BadRequestError, match="writes no reasoning"):
        await sdk.messages.create(model="tiny", max_tokens=2048, messages=MESSAGES,
                                  thinking={"type": "enabled", "budget_tokens": 1024})


async def test_langchain_receives_the_thinking(qwen3, make_client):
    """LangChain's OpenAI chat model on the Responses API (its way to a
    model's reasoning) gets the thinking as a reasoning block, and sends
    it back in the next turn."""
    from langchain_openai import ChatOpenAI

    set_script(qwen3, SCRIPT)
    client = await make_client(qwen3)
    chat = ChatOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", model="tiny", max_retries=0,
                      use_responses_api=True, max_tokens=100)
    reply = await chat.ainvoke("hi")
    blocks = {block["type"]: block for block in reply.content}
    assert blocks["reasoning"]["content"][0]["text"] == THOUGHT
    assert reply.text == ANSWER
    streamed = None
    async for chunk in chat.astream("hi"):
        streamed = chunk if streamed is None else streamed + chunk
    # streamed, LangChain reads a reasoning item's summary events only (OpenAI's
    # own models); the thinking's text events (`response.reasoning_text.*`)
    # it passes over
    assert streamed.text == ANSWER
    again = await chat.ainvoke([("user", "hi"), reply, ("user", "and?")])
    assert again.text == ANSWER
