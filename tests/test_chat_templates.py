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
import types

import pytest

from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.models.loading import registered_tool_call_formats
from lockgate.models.tokenizer import load_tokenizer
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.request import CHAT_ENDPOINT, parse_request
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

NO_SYSTEM_ROLE = (
    "Gemma 2's template refuses a system message (400); llama.cpp merges it into the next "
    "message for a template without a system role, lockgate passes it on as it is"
)
TOOL_USE_ONLY = (
    "a tool_use template loops over `tools` unguarded: without tools it raises TypeError, a 500. "
    "GGUF files carry it as tokenizer.chat_template.tool_use beside a plain default, which "
    "llama.cpp picks when no tools are offered; lockgate reads only tokenizer.chat_template"
)
KNOWN = {
    ("conversation", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"): TOOL_USE_ONLY,
    ("bos", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"): TOOL_USE_ONLY,
    ("conversation", "google-gemma-2-2b-it"): NO_SYSTEM_ROLE,
    ("tools", "google-gemma-2-2b-it"): (
        "the tool instructions go into a system message, which Gemma 2's template refuses: every "
        "request with tools is a 400 (llama.cpp would merge it into the first user message)"
    ),
    ("history", "google-gemma-2-2b-it"): NO_SYSTEM_ROLE,
    ("history", "mistralai-Mistral-Nemo-Instruct-2407"): (
        "Mistral's templates want tool call ids of 9 letters and digits; lockgate's are "
        "'call_' and 24 hex digits, so a client sending back its calls gets a 400"
    ),
    ("history", "Mistral-Small-3.2-24B-Instruct-2506"): (
        "Mistral's templates want tool call ids of 9 letters and digits; lockgate's are "
        "'call_' and 24 hex digits, so a client sending back its calls gets a 400"
    ),
    ("bos", "microsoft-Phi-3.5-mini-instruct"): (
        "the template writes no <s> and the vocabulary asks for BOS (add_bos_token): llama.cpp's "
        "server strips a BOS the template wrote and tokenizes with add_special, so its prompt "
        "starts with one BOS; lockgate's chat path adds none"
    ),
    ("format", "Qwen3-Coder"): (
        "Qwen3-Coder writes <tool_call><function=name><parameter=key>value</parameter>...; no "
        "format reads that, and hermes (picked for the <tool_call> tag) expects JSON inside"
    ),
    ("format", "Qwen3.5-4B"): (
        "Qwen3.5 writes Qwen3-Coder's XML calls; no format reads them, and hermes (picked for "
        "the <tool_call> tag) expects JSON inside"
    ),
    ("format", "google-gemma-4-31B-it"): (
        "Gemma 4 writes <|tool_call>call:name{...}<tool_call|>; no format reads that, and the "
        "generic JSON envelope is picked while the template itself tells the model its own syntax"
    ),
}

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


@functools.cache
def model(name: str):
    """What the prompt hooks read of a model: its name, tokenizer (with the
    template) and tool-call format."""
    vocab, _ = TEMPLATES[name]
    models = reference_models_dir()
    template = (models / "templates" / f"{name}.jinja").read_text("utf-8")
    tokenizer = load_tokenizer(GGUFMetadata(models / f"ggml-vocab-{vocab}.gguf"), chat_template=template)
    formats = registered_tool_call_formats(plugin_manager())
    return types.SimpleNamespace(
        name=name, tokenizer=tokenizer, tool_call_format=choose_tool_call_format(formats, None, template)
    )


def serve(name: str, body: dict) -> tuple[str, list[int]]:
    """The prompt and token ids lockgate makes of a chat request."""
    hooks = plugin_manager().hook
    request = parse_request(CHAT_ENDPOINT, body, request_id="t")
    prompt = hooks.lockgate_render_prompt(request=request, model=model(name))
    return prompt, hooks.lockgate_tokenize(prompt=prompt, request=request, model=model(name))


CONVERSATION = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]}


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
    body = {
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
    prompt, _ = serve(name, body)
    assert "Paris" in prompt and "18 C and sunny" in prompt


@pytest.mark.parametrize("name", cases("format"))
def test_tool_call_format_is_the_one_the_model_writes(name):
    _, expected = TEMPLATES[name]
    assert model(name).tool_call_format.name == expected
