"""Tokenizers built from real vocabularies agree with llama.cpp.

The vocabularies are llama.cpp's own reference files (`ggml-vocab-*.gguf`:
the tokenizer metadata of real models, without weights), fetched from the
llama-cpp-python sdist by `llama_cpp_reference`. Each is checked against

- the test vectors llama.cpp ships with it (`.inp`/`.out`), which its
  `tests/test-tokenizer-0.cpp` makes with `common_tokenize(text,
  add_special=false, parse_special=false)`: here `encode(text,
  add_special_tokens=False, split_special_tokens=True)`;
- `tokenizer_golden.json`, written by `make_tokenizer_golden.py` with
  llama-cpp-python 0.3.36 from the same files (and from "gemma3-style",
  Llama 2's vocabulary set up as Gemma 3's files are, since llama.cpp ships
  no Gemma 3 vocabulary): chat-like prompts tokenized
  with `parse_special=True` (with and without the special tokens the
  vocabulary adds), the end-of-generation ids, and a hash of every token's
  piece (`llama_token_to_piece`, with and without special tokens), which is
  what llama.cpp's server sends for each generated token.

Decoding, whole and streamed, must give exactly the pieces' bytes.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
import json
import pathlib
import struct
import subprocess
import sys
import time

import pytest

from paths import DATA
from lockgate.plugin_api import grammars
from lockgate.engine.detokenizer import IncrementalDetokenizer
from lockgate.plugin_api.grammars import compile_json_schema
from lockgate.errors import ModelLoadError
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.models.text_tokenizer import TokenBytes
from lockgate.models.tokenizer import eos_token_ids, load_tokenizer
from llama_cpp_reference import read_vocab_tests, reference_models_dir, write_gemma3_style_vocab

GOLDEN = json.loads((DATA / "tokenizer_golden.json").read_text("utf-8"))

VOCABS = sorted(GOLDEN["vocabs"])
GEMMA3_STYLE = "gemma3-style"
WITH_VECTORS = [name for name in VOCABS if name != GEMMA3_STYLE]
# GPT-2's stand-ins for the 256 bytes: printable Latin-1 as itself, the rest
# from U+0100 on.
BYTE_ALPHABET = {chr(c) for c in (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x144))}
SENTENCEPIECE_STYLE = {"llama-spm", "phi-3", GEMMA3_STYLE, "gemma-4"}


@functools.cache
def models_dir() -> pathlib.Path:
    return reference_models_dir()


@functools.cache
def vocab_path(name: str) -> pathlib.Path:
    if name == GEMMA3_STYLE:
        return write_gemma3_style_vocab(pathlib.Path(tempfile.mkdtemp()) / f"{name}.gguf")
    return models_dir() / f"ggml-vocab-{name}.gguf"


@functools.cache
def loaded(name: str):
    """(metadata, tokenizer, seconds the tokenizer took to build) for one vocabulary."""
    metadata = GGUFMetadata(vocab_path(name))
    start = time.perf_counter()
    tokenizer = load_tokenizer(metadata)
    return metadata, tokenizer, time.perf_counter() - start


def special_ids(tokenizer) -> set[int]:
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def pieces(tokenizer, token_ids, *, skip_special: bool = False) -> bytes:
    token_bytes = TokenBytes(tokenizer)
    special = special_ids(tokenizer) if skip_special else set()
    return b"".join(b"" if i in special else token_bytes(i) for i in token_ids)


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_llama_cpp_test_vectors(name):
    _, tokenizer, _ = loaded(name)
    tests = read_vocab_tests(vocab_path(name))
    assert len(tests) >= 40
    wrong = [
        (test.text, test.ids, ids)
        for test in tests
        if (ids := tokenizer.encode(test.text, add_special_tokens=False, split_special_tokens=True))
        != test.ids
    ]
    assert not wrong, f"{len(wrong)} of {len(tests)} vectors differ; first: {wrong[0]}"


@pytest.mark.parametrize("name", VOCABS)
def test_prompts_with_special_tokens(name):
    _, tokenizer, _ = loaded(name)
    for prompt in GOLDEN["vocabs"][name]["prompts"]:
        text = prompt["text"]
        assert tokenizer.encode(text, add_special_tokens=False) == prompt["ids"], text
        assert tokenizer.encode(text) == prompt["ids_add_special"], text


@pytest.mark.parametrize("name", VOCABS)
def test_end_of_generation_ids(name):
    metadata, tokenizer, _ = loaded(name)
    ids = eos_token_ids(metadata, tokenizer)
    assert sorted(ids) == GOLDEN["vocabs"][name]["end_of_generation"]
    assert ids[0] == metadata.fields["tokenizer.ggml.eos_token_id"].contents()


def piece_hash(tokenizer, n_vocab: int, *, skip_special: bool) -> str:
    digest = hashlib.sha256()
    token_bytes = TokenBytes(tokenizer)
    special = special_ids(tokenizer) if skip_special else set()
    for token_id in range(n_vocab):
        piece = b"" if token_id in special else token_bytes(token_id)
        digest.update(struct.pack("<I", len(piece)) + piece)
    return digest.hexdigest()


@pytest.mark.parametrize("name", VOCABS)
def test_token_bytes_are_llama_cpp_pieces(name):
    _, tokenizer, _ = loaded(name)
    golden = GOLDEN["vocabs"][name]
    assert len(tokenizer) == golden["n_vocab"]
    assert piece_hash(tokenizer, golden["n_vocab"], skip_special=False) == golden["pieces"]
    # without special tokens: exactly the control and unknown ones are hidden
    assert piece_hash(tokenizer, golden["n_vocab"], skip_special=True) == golden["pieces_no_special"]


def decoded_texts(name):
    """Every vector's and prompt's ids, with what decoding them must give."""
    _, tokenizer, _ = loaded(name)
    cases = [t.ids for t in read_vocab_tests(vocab_path(name))] if name in WITH_VECTORS else []
    cases += [p["ids_add_special"] for p in GOLDEN["vocabs"][name]["prompts"]]
    # DeepSeek's user-defined "õ", "÷", ... (one for each byte that UTF-8
    # never uses) are their UTF-8 text for llama.cpp and for TokenBytes, but
    # the byte-level decoder reads "õ" as the byte 0xF5: `tokenizers` runs
    # added tokens through the decoder like any other. Only tokens spelled
    # wholly in the byte alphabet and not ASCII are affected; a model has no
    # reason to write these.
    misread = {
        i for i, token in tokenizer.added_tokens_decoder.items()
        if not token.special and not token.content.isascii() and set(token.content) <= BYTE_ALPHABET
    } if name not in SENTENCEPIECE_STYLE else set()
    for ids in cases:
        if not misread.intersection(ids):
            yield ids


@pytest.mark.parametrize("name", VOCABS)
def test_decoding_gives_the_pieces_whole_and_streamed(name):
    _, tokenizer, _ = loaded(name)
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    checked = 0
    for ids in decoded_texts(name):
        for skip_special in (False, True):
            expected = pieces(tokenizer, ids, skip_special=skip_special).decode("utf-8")
            assert tokenizer.decode(ids, skip_special_tokens=skip_special) == expected
            for context in ([], prompt):
                detokenizer = IncrementalDetokenizer(tokenizer, context, skip_special_tokens=skip_special)
                streamed = [detokenizer.add(i).text for i in ids]
                streamed.append(detokenizer.finish())
                assert "".join(streamed) == expected, (ids, streamed)
                # a character split over byte tokens comes out whole, once complete
                assert not any("\ufffd" in text for text in streamed)
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("name", sorted(SENTENCEPIECE_STYLE))
def test_sentencepiece_spelling(name):
    _, tokenizer, _ = loaded(name)
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(" Hello\n🦙", add_special_tokens=False)
    spelled = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    # Llama 2's vocabulary has no "\n": it is the byte token <0x0A>;
    # without a space prefix, "▁Hello" needs the space in the text
    newline = "\n" if name == "gemma-4" else "<0x0A>"
    assert spelled[-5:] == [newline, "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert [token_bytes(i) for i in ids[-5:]] == [b"\n", b"\xf0", b"\x9f", b"\xa6", b"\x99"]
    assert "▁Hello" in spelled and token_bytes(ids[spelled.index("▁Hello")]) == b" Hello"
    # The llama emoji arrives in four steps and is sent once whole.
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
    assert [detokenizer.add(i).text for i in ids[-4:]] == ["", "", "", "🦙"]


def test_sentencepiece_leading_space_is_kept():
    # llama.cpp adds a space before a text that follows the start or a special
    # token (add_space_prefix); its server sends each generated token's piece
    # as it is, so a reply after "[/INST]" starts with the space its first
    # token carries. Decoding does the same, the first token included.
    _, tokenizer, _ = loaded("llama-spm")
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["▁Hello", "▁world"]
    assert tokenizer.decode(ids) == " Hello world"
    assert tokenizer.encode("Hello world")[0] == tokenizer.bos_token_id  # add_bos_token
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("[INST] Hi [/INST]"))
    assert [detokenizer.add(i).text for i in ids] == [" Hello", " world"]


def test_gemma3_style_adds_no_space_and_keeps_whitespace_tokens_whole():
    # Gemma 3's files turn the space prefix off and list runs of spaces as
    # user-defined tokens, which llama.cpp matches by their text first.
    _, tokenizer, _ = loaded(GEMMA3_STYLE)
    ids = tokenizer.encode("a   b\n\nc", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "   ", "b", "\n\n", "c"]
    assert tokenizer.decode(ids) == "a   b\n\nc"
    turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert turn in eos_token_ids(loaded(GEMMA3_STYLE)[0], tokenizer)
    assert tokenizer.decode([*ids, turn], skip_special_tokens=True) == "a   b\n\nc"


def test_gemma4_keeps_text_as_written():
    # Gemma 4 adds no space in front, splits at newlines and keeps runs of
    # them whole, and llama.cpp adds BOS whatever the file says.
    _, tokenizer, _ = loaded("gemma-4")
    ids = tokenizer.encode("Hello  world\n\n\tx", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["Hello", "▁▁", "world", "\n\n", "\t", "x"]
    assert tokenizer.decode(ids) == "Hello  world\n\n\tx"
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id


@pytest.mark.parametrize("name", ["llama-spm", GEMMA3_STYLE, "gemma-4"])
def test_structured_output_sees_the_same_tokens(name):
    # The grammar engine reads the tokenizer's own serialisation; for
    # SentencePiece vocabularies it must find the same bytes per token.
    metadata, tokenizer, _ = loaded(name)
    eos = eos_token_ids(metadata, tokenizer)
    engine_tokenizer = grammars._llg_tokenizer(tokenizer, eos)
    token_bytes = TokenBytes(tokenizer)
    differ = [
        i for i in range(len(tokenizer))
        if engine_tokenizer.decode_bytes([i]) != token_bytes(i)
    ]
    # llguidance keeps the byte 0xFF (never in UTF-8) to mark special tokens
    assert [token_bytes(i) for i in differ] == [b"\xff"]
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = compile_json_schema(schema, tokenizer, eos_token_ids=eos).matcher()
    document = '{"name": "Zoë 🦙"}'
    ids = engine_tokenizer.tokenize_str(document)
    assert tokenizer.decode(ids) == document
    for token_id in ids:
        assert matcher.allowed(len(tokenizer))[token_id], tokenizer.convert_ids_to_tokens(token_id)
        matcher.accept(token_id)
    assert matcher.allowed(len(tokenizer))[eos[0]]


def test_unsupported_vocabulary_kind_is_a_clear_load_error():
    metadata = GGUFMetadata(models_dir() / "ggml-vocab-bert-bge.gguf")
    with pytest.raises(ModelLoadError, match="unsupported tokenizer model 'bert'.*'gpt2'.*'llama'"):
        load_tokenizer(metadata)


def test_loading_does_not_import_torch():
    # transformers' GGUF converter lives next to its torch model loader.
    code = (
        "import sys; from lockgate.models.gguf_metadata import GGUFMetadata; "
        "from lockgate.models.tokenizer import load_tokenizer; "
        f"load_tokenizer(GGUFMetadata({str(models_dir() / 'ggml-vocab-llama-spm.gguf')!r})); "
        "load_tokenizer(GGUFMetadata(" + repr(str(models_dir() / "ggml-vocab-gemma-4.gguf")) + ")); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


@pytest.mark.parametrize("name", ["gemma-4", "command-r", "qwen2", "llama-bpe"])
def test_large_vocabularies_load_quickly(name):
    # 150k-262k tokens; measured 0.5-2.0 s on a 2-core machine.
    _, _, seconds = loaded(name)
    assert seconds < 15
