"""Real chat templates through lockgate's own prompt path.

The templates are llama.cpp's copies of the models' own
(`models/templates/*.jinja`, fetched by `llama_cpp_reference`), each paired
with a reference vocabulary of its family so that special tokens and BOS are
real. Each is rendered by the built-in `lockgate_render_prompt` and
tokenized by the built-in `lockgate_tokenize`, as a chat request is served:
with a system and a user message, with tools offered, and with an earlier
tool call and its result. `choose_tool_call_format` must pick the format the
model was trained to write.

Cases marked xfail are what lockgate does not handle yet; each reason says
what goes wrong.
"""

from __future__ import annotations

import functools
import json
import re
import types

import pytest

from lockgate.errors import InvalidMessages
from lockgate.models.gguf_metadata import GGUFMetadata, MetadataField
from lockgate.models.loading import registered_reasoning_formats, registered_tool_call_formats
from lockgate.models.tokenizer import load_tokenizer
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.request import CHAT_ENDPOINT, parse_request
from lockgate.plugin_api.reasoning import choose_reasoning_format
from lockgate.plugin_api.tool_calls import choose_tool_call_format
from llama_cpp_reference import reference_models_dir

# template -> (reference vocabulary of its family, the tool-call format it writes)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("qwen2", "hermes"),
    "Qwen-Qwen3-0.6B": ("qwen2", "hermes"),
    "Qwen-QwQ-32B": ("qwen2", "hermes"),
    "Qwen3-Coder": ("qwen2", "qwen3-coder"),
    "Qwen3.5-4B": ("qwen35", "qwen3-coder"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek-llm", "generic"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("deepseek-llm", "generic"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama-bpe", "llama3"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama-bpe", "llama3"),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama-bpe", "llama3"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("llama-bpe", "hermes"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("llama-spm", "mistral"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("llama-spm", "mistral"),
    "google-gemma-2-2b-it": ("gemma-4", "generic"),
    "google-gemma-4-31B-it": ("gemma-4", "gemma4"),
    "microsoft-Phi-3.5-mini-instruct": ("phi-3", "generic"),
}

KNOWN: dict[tuple[str, str], str] = {}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
CALL_ID = "call_0123456789abcdef01234567"  # as lockgate makes them


def cases(check: str):
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN[check, name]))
        if (check, name) in KNOWN else name
        for name in TEMPLATES
    ]


@functools.cache
def plugin_manager():
    return get_plugin_manager(autoload=False)


#: Hermes 3's default template (ChatML), which its GGUF files carry as
#: tokenizer.chat_template beside the tool_use one llama.cpp ships
HERMES_DEFAULT = (
    "{{bos_token}}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def template_text(name: str) -> str:
    return (reference_models_dir() / "templates" / f"{name}.jinja").read_text("utf-8")


def vocabulary(name: str) -> GGUFMetadata:
    vocab, _ = TEMPLATES[name]
    return GGUFMetadata(reference_models_dir() / f"ggml-vocab-{vocab}.gguf")


def with_tool_use_template(name: str) -> GGUFMetadata:
    metadata = vocabulary(name)
    metadata.fields["tokenizer.chat_template"] = MetadataField(HERMES_DEFAULT)
    metadata.fields["tokenizer.chat_template.tool_use"] = MetadataField(template_text(name))
    return metadata


@functools.cache
def model(name: str):
    """What the prompt hooks read of a model: its name, tokenizer (with the
    template), tool-call format and reasoning format. A `-tool_use` template is what a GGUF
    file carries as `tokenizer.chat_template.tool_use`, beside the model's
    plain default; the others replace the vocabulary's template."""
    template = template_text(name)
    if name.endswith("-tool_use"):
        tokenizer = load_tokenizer(with_tool_use_template(name))
    else:
        tokenizer = load_tokenizer(vocabulary(name), chat_template=template)
    # the format the template offering tools writes (llama.cpp reads calls
    # by the template it rendered with)
    formats = registered_tool_call_formats(plugin_manager())
    thinking = choose_reasoning_format(registered_reasoning_formats(plugin_manager()), None, template)
    return types.SimpleNamespace(
        name=name, tokenizer=tokenizer, tool_call_format=choose_tool_call_format(formats, None, template),
        reasoning_format=thinking,
    )


def serve(name: str, body: dict) -> tuple[str, list[int]]:
    """The prompt and token ids lockgate makes of a chat request."""
    hooks = plugin_manager().hook
    request = parse_request(CHAT_ENDPOINT, body, request_id="t")
    prompt = hooks.lockgate_render_prompt(request=request, model=model(name))
    return prompt, hooks.lockgate_tokenize(prompt=prompt, request=request, model=model(name))


CONVERSATION = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]}

#: a conversation with an earlier call and its result
HISTORY = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": CALL_ID, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C and sunny"},
    ],
    "tools": TOOLS,
}


@pytest.mark.parametrize("name", cases("conversation"))
def test_renders_a_conversation(name):
    prompt, ids = serve(name, CONVERSATION)
    assert "Hi there" in prompt and "Be brief." in prompt
    # every special token the template wrote is one token (decoding does not
    # give the prompt back: SentencePiece adds a space after each special
    # token and Phi-3's strip the whitespace after them, as in llama.cpp)
    tokenizer = model(name).tokenizer
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if token.special and token.content in prompt:
            assert ids.count(token_id) == prompt.count(token.content), token.content


@pytest.mark.parametrize("name", cases("bos"))
def test_bos_as_llama_cpp_serves_it(name):
    # llama.cpp's server takes a BOS the template wrote off the rendered text
    # and tokenizes with add_special: one BOS exactly when the vocabulary
    # asks for it, else what the template wrote.
    body = {"messages": [{"role": "user", "content": "Hi there"}]}
    prompt, ids = serve(name, body)
    tokenizer = model(name).tokenizer
    leading = next((n for n, i in enumerate(ids) if i != tokenizer.bos_token_id), len(ids))
    expected = 1 if tokenizer.add_bos_token else int(prompt.startswith(tokenizer.bos_token or "\0"))
    assert leading == expected


@pytest.mark.parametrize("name", cases("tools"))
def test_renders_the_offered_tools(name):
    prompt, _ = serve(name, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS})
    assert "get_weather" in prompt and "Weather in Paris?" in prompt


@pytest.mark.parametrize("name", cases("history"))
def test_renders_an_earlier_call_and_its_result(name):
    prompt, _ = serve(name, HISTORY)
    assert "Paris" in prompt and "18 C and sunny" in prompt


@pytest.mark.parametrize("name", cases("format"))
def test_tool_call_format_is_the_one_the_model_writes(name):
    _, expected = TEMPLATES[name]
    assert model(name).tool_call_format.name == expected


def test_a_system_message_goes_into_the_first_turn_where_the_template_has_no_system_role():
    # llama.cpp: the system text, a newline, then the next message's
    prompt, _ = serve("google-gemma-2-2b-it", CONVERSATION)
    assert "<start_of_turn>user\nBe brief.\nHi there<end_of_turn>" in prompt
    alone, _ = serve("google-gemma-2-2b-it", {"messages": [{"role": "system", "content": "Be brief."}]})
    assert "<start_of_turn>user\nBe brief.<end_of_turn>" in alone  # not dropped, as llama.cpp would
    # a template with a system role keeps it as it is
    prompt, _ = serve("Qwen-Qwen2.5-7B-Instruct", CONVERSATION)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt


def test_the_tool_use_template_renders_requests_with_tools_and_the_default_the_others():
    name = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"
    assert set(model(name).tokenizer.named_chat_templates) == {"tool_use"}
    tools = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    assert "function calling AI model" in serve(name, tools)[0]
    plain, _ = serve(name, {**tools, "tool_choice": "none"})  # tools the model does not see
    assert "function calling AI model" not in plain and plain.endswith("<|im_start|>assistant\n")
    # an override replaces the file's templates, named ones too (llama.cpp's --chat-template)
    overridden = load_tokenizer(with_tool_use_template(name), chat_template=template_text(name))
    assert overridden.named_chat_templates == {}


def test_a_template_that_breaks_on_a_request_refuses_it_as_a_400():
    # the tool_use template alone (as --chat-template), asked without tools:
    # its unguarded loop over `tools` raises TypeError, which was a 500
    name = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"
    only = types.SimpleNamespace(
        name=name, tokenizer=load_tokenizer(vocabulary(name), chat_template=template_text(name)),
        tool_call_format=model(name).tool_call_format, reasoning_format=None,
    )
    request = parse_request(CHAT_ENDPOINT, CONVERSATION, request_id="t")
    with pytest.raises(InvalidMessages, match="TypeError") as refused:
        plugin_manager().hook.lockgate_render_prompt(request=request, model=only)
    assert (refused.value.status, refused.value.param) == (400, "messages")


def test_mistral_gets_a_call_and_its_result_under_one_id_of_its_shape():
    prompt, _ = serve("mistralai-Mistral-Nemo-Instruct-2407", HISTORY)
    [called] = re.findall(r'"id": "(\w+)"', prompt)
    [answered] = re.findall(r'"call_id": "(\w+)"', prompt)
    assert called == answered and re.fullmatch("[A-Za-z0-9]{9}", called)


@pytest.mark.parametrize("name", [n for n, (_, fmt) in TEMPLATES.items() if fmt in ("hermes", "qwen3-coder", "gemma4")])
def test_the_format_reads_a_call_as_the_template_writes_it(name):
    # the model learnt its calls from this spelling: the format that reads
    # its output must read it back
    prompt, _ = serve(name, HISTORY)
    after_the_question = prompt[prompt.rindex("Weather in Paris?"):]  # not the instructions' example
    parsed = model(name).tool_call_format.with_tools([]).parse(after_the_question)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "llguidance.hf.from_tokenizer takes every added token for a special one (is_special_token(48) is "
    "True for Gemma 4's user-defined <|tool_call>), so a grammar's literal '<|tool_call>' refuses the "
    "model's own token and is forced spelled out in pieces; the fix belongs where the engine builds "
    "llguidance's tokenizer (lockgate.engine.structured)"
))
def test_gemma4s_required_grammar_takes_its_own_marker_tokens():
    from lockgate.plugin_api.grammars import compile_grammar
    from lockgate.plugin_api.tool_calls import Tool

    name = "google-gemma-4-31B-it"
    tokenizer = model(name).tokenizer
    tool = Tool(TOOLS[0]["function"]["name"], None, TOOLS[0]["function"]["parameters"])
    grammar = compile_grammar(model(name).tool_call_format.grammar([tool], required=True, max_calls=1), tokenizer)
    matcher = grammar.matcher()
    call = '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>'
    for token in tokenizer.encode(call, add_special_tokens=False):
        matcher.accept(token)
    assert matcher.is_accepting
