"""`TextTokenizer` and `render_chat_template` answer as transformers does.

lockgate's tokenizer no longer runs through transformers (its import cost a
serving process about 20 MiB, issue 38). These tests hold the replacement to
transformers' `PreTrainedTokenizerFast` over the same `tokenizers` backend
(built from llama.cpp's reference vocabularies, `llama_cpp_reference`):
encoding with and without BOS/EOS, decoding, the special tokens and their
ids, the vocabulary; and every real chat template llama.cpp ships, rendered
for the same conversations by both.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import subprocess
import sys

import jinja2
import pytest
from tokenizers import Tokenizer, models

from lockgate.models.chat_template import render_chat_template
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.models.hf import load_hf_tokenizer
from lockgate.models.text_tokenizer import TextTokenizer
from lockgate.models.tokenizer import load_tokenizer
from llama_cpp_reference import reference_models_dir
from tiny_model import save_hf_tokenizer

transformers = pytest.importorskip("transformers")

VOCABS = ["llama-bpe", "llama-spm", "qwen2", "phi-3", "gemma-4", "command-r", "deepseek-coder"]
TEXTS = [
    "Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>", "<s>[INST] x [/INST]", "Zoë 🦙 ünïcode",
    "<|begin_of_text|><|start_header_id|>", "tabs\tand\n\nnewlines  ", "",
]


@functools.cache
def ours(name: str) -> TextTokenizer:
    return load_tokenizer(GGUFMetadata(reference_models_dir() / f"ggml-vocab-{name}.gguf"))


@functools.cache
def theirs(name: str):
    """transformers' fast tokenizer over a copy of the same backend, set up
    as lockgate set it up before it had its own class."""
    tokenizer = ours(name)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(tokenizer.backend_tokenizer),
        add_bos_token=tokenizer.add_bos_token,
        add_eos_token=tokenizer.add_eos_token,
        clean_up_tokenization_spaces=False,
        chat_template=tokenizer.chat_template,
        **{name: tokenizer.special_tokens_map.get(name) for name in ("bos_token", "eos_token", "unk_token",
                                                                      "pad_token")},
    )


@pytest.mark.parametrize("name", VOCABS)
def test_encoding_and_decoding_are_transformers(name):
    mine, reference = ours(name), theirs(name)
    for text in TEXTS:
        for special in (True, False):
            ids = mine.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert mine.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip), (text, skip)
        assert mine.encode(text, split_special_tokens=True) == reference.encode(text, split_special_tokens=True)
    assert mine.decode(5) == reference.decode(5)
    assert mine.decode([], skip_special_tokens=True) == ""


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_and_vocabulary_are_transformers(name):
    mine, reference = ours(name), theirs(name)
    assert mine.special_tokens_map == reference.special_tokens_map
    assert mine.all_special_ids == reference.all_special_ids
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "bos_token_id",
                      "eos_token_id", "unk_token_id", "pad_token_id", "sep_token_id"):
        assert getattr(mine, attribute) == getattr(reference, attribute), attribute
    assert len(mine) == len(reference)
    assert mine.vocab_size == reference.vocab_size
    assert mine.get_vocab() == reference.get_vocab()
    assert {i: (t.content, t.special) for i, t in mine.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    some = [0, 1, 2, len(mine) // 2, len(mine) - 1]
    assert mine.convert_ids_to_tokens(some) == reference.convert_ids_to_tokens(some)
    assert mine.convert_ids_to_tokens(3) == reference.convert_ids_to_tokens(3)


def test_a_named_special_token_outside_the_added_tokens_becomes_one():
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<pad>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer = TextTokenizer(backend, special_tokens={"pad_token": "<pad>", "eos_token": "<end>"},
                              add_eos_token=True)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.eos_token_id == 4  # added at the end of the vocabulary
    assert {t.content for t in tokenizer.added_tokens_decoder.values() if t.special} == {"<pad>", "<end>"}
    assert tokenizer.decode([2, 4], skip_special_tokens=True) == ""
    with pytest.raises(ValueError, match="unknown special token names: bogus_token"):
        TextTokenizer(backend, special_tokens={"bogus_token": "a"})


def test_a_hugging_face_directory_loads_as_transformers_loads_it(tmp_path):
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    source = load_tokenizer(GGUFMetadata(reference_models_dir() / "ggml-vocab-llama-bpe.gguf"), chat_template=chatml)
    save_hf_tokenizer(source, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    mine = load_hf_tokenizer(tmp_path)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path), local_files_only=True)
    for text in TEXTS:
        assert mine.encode(text) == reference.encode(text), text
    assert mine.special_tokens_map == reference.special_tokens_map
    assert mine.chat_template == source.chat_template  # chat_template.jinja wins over the config
    assert mine.named_chat_templates == {"tool_use": "{{ 'tools' }}"}
    messages = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(messages, tools=[{"type": "function"}], tokenize=False) == "tools"
    assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert mine.apply_chat_template(messages, add_generation_prompt=True) == mine.encode(
        mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


# ------------------------------------------------------------------ chat templates

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = {
    "one user message": ([{"role": "user", "content": "Hello, who are you?"}], None),
    "system and turns": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."},
        {"role": "user", "content": "Zoë 🦙 <b>&</b>"},
    ], None),
    "a tool call and its result": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
    ], TOOLS),
    "content parts": ([{"role": "user", "content": [{"type": "text", "text": "part one"}]}], None),
}


def template_paths() -> list[pathlib.Path]:
    return sorted((reference_models_dir() / "templates").glob("*.jinja"))


def _render(render):
    try:
        return "ok", render()
    except jinja2.TemplateError as exc:
        return "template error", type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - a template's own code failing is an outcome too
        return "failed", type(exc).__name__


def test_every_llama_cpp_template_renders_as_transformers_renders_it():
    reference = theirs("llama-bpe")
    special = dict(reference.special_tokens_map)
    paths = template_paths()
    assert len(paths) >= 40
    differ, rendered = [], 0
    for path in paths:
        template = path.read_text(encoding="utf-8")
        for label, (messages, tools) in CONVERSATIONS.items():
            for generation in (True, False):
                kwargs = dict(tools=tools, add_generation_prompt=generation)
                mine = _render(lambda: render_chat_template(template, messages, **special, **kwargs))
                expected = _render(lambda: reference.apply_chat_template(
                    messages, chat_template=template, tokenize=False, **kwargs))
                rendered += mine[0] == "ok"
                if mine != expected:
                    differ.append((path.stem, label, generation, mine, expected))
    assert not differ, f"{len(differ)} renders differ; first: {differ[0]}"
    assert rendered >= len(paths) * len(CONVERSATIONS)  # most render: the comparison is not of two errors


def test_the_sandbox_holds():
    attempts = [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ messages.append(1) }}",
    ]
    for template in attempts:
        with pytest.raises(jinja2.exceptions.SecurityError):
            render_chat_template(template, [{"role": "user", "content": "x"}])
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="at least one message"):
        render_chat_template("{{ 1 }}", [])


def test_serving_imports_no_transformers():
    """The server's modules and a GGUF tokenizer load without transformers."""
    vocab = reference_models_dir() / "ggml-vocab-llama-spm.gguf"
    code = (
        "import sys; import lockgate.server.app; from lockgate.models.gguf_metadata import GGUFMetadata; "
        "from lockgate.models.tokenizer import load_tokenizer; "
        f"t = load_tokenizer(GGUFMetadata({str(vocab)!r})); "
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}], chat_template='{{ messages[0].content }}'); "
        "from lockgate.plugin_api.grammars import compile_json_schema; "
        "compile_json_schema({'type': 'string'}, t, eos_token_ids=[t.eos_token_id]); "
        "found = [m for m in ('transformers', 'torch') if m in sys.modules]; "
        "assert not found, found"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
