"""Writes `tokenizer_golden.json`: what llama.cpp itself makes of the reference
vocabularies, beyond the `.inp`/`.out` vectors it ships with them.

Run it with a Python that has llama-cpp-python 0.3.36 installed (the version
`llama_cpp_reference` takes the vocabularies from), from this directory:

    python tests/support/make_tokenizer_golden.py > tests/data/tokenizer_golden.json

For every vocabulary `test_tokenizer_vectors.py` covers it records

- ``end_of_generation``: the ids `llama_vocab_is_eog` accepts;
- ``pieces`` / ``pieces_no_special``: a SHA-256 over every token's
  `llama_token_to_piece` (special=True / special=False), each prefixed with
  its length as a little-endian uint32: what a server sends per token
  (``unk_byte_pieces`` counts those taken as the token's text instead, see
  `piece_hash`);
- ``prompts``: chat-like texts made of the vocabulary's own special tokens,
  with the ids of `llama_tokenize(text, add_special, parse_special=True)`
  without (``ids``) and with (``ids_add_special``) the special tokens the
  vocabulary adds.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
import sys

import pathlib
import tempfile

import llama_cpp

from llama_cpp_reference import (
    LLAMA_CPP_PYTHON_VERSION, read_vocab_tests, reference_models_dir, write_gemma3_style_vocab,
)

GEMMA3_STYLE = "gemma3-style"
"""Llama 2's vocabulary set up as Gemma 3's files are (`write_gemma3_style_vocab`)."""

VOCABS = [
    "command-r", "deepseek-coder", "deepseek-llm", "falcon", GEMMA3_STYLE, "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
]

# Conversations as the model families' chat templates write them.
CHATS = {
    "llama-spm": [
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is  2+2? [/INST] Four. </s><s>[INST] And 🦙? [/INST]",
    ],
    "phi-3": [
        "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is  2+2?<|end|>\n<|assistant|>\nFour.<|end|>\n"
        "<|user|>\n  And 🦙?</s> x<|end|>\n<|assistant|>\n",
    ],
    "gemma-4": [
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWhat is  2+2?<turn|>\n<|turn>model\n"
        "<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|></s><turn|>\n<|turn>model\n",
    ],
    "qwen2": [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is  2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nFour.</s><|im_end|>\n<|im_start|>assistant\n",
    ],
    "llama-bpe": [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is  2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ],
    "command-r": [
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is  2+2?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ],
    "deepseek-llm": [
        "<｜begin▁of▁sentence｜>User: What is  2+2?\n\nAssistant: Four.<｜end▁of▁sentence｜>õ÷",
    ],
}
CHATS["qwen35"] = CHATS["qwen2"]
CHATS[GEMMA3_STYLE] = [
    "<start_of_turn>user\nHi  there\n\n\tx<end_of_turn>\n<start_of_turn>model\n",
    "a   b\t\tc <b>bold</b>",
    "  lead",
    "<b> x",
]

# Filled with the vocabulary's own special tokens ({c0}...) and user-defined
# ones ({u0}, {u1}; empty when it has none).
GENERIC = [
    "{c0}Hello  world!{c1}\n{c2} x{c0}\n",
    "{c1}{c2} 🦙 naïve café\n\n  {u0}tail{u1} ",
    " lead{c0}   spaced   {c1}\t\n",
    "plain text with 日本語, emoji 😶\u200d🌫️ and  double  spaces",
    "",
]


def token_to_piece(vocab, token_id: int, special: bool) -> bytes:
    """`llama_token_to_piece` (llama-cpp-python's own wrapper returns its
    whole buffer, NULs and all)."""
    size = 64
    while True:
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, size, 0, special)
        if n >= 0:
            return buffer.raw[:n]
        size = -n


def piece_hash(vocab, n_vocab: int, special: bool) -> tuple[str, int]:
    """The hash of every token's piece, and how many pieces were replaced.

    A byte-level token whose text holds characters outside the byte alphabet
    (Command-R has 1,403, such as "‼") comes out of llama.cpp as
    "[UNK_BYTE_0x…]" followed by the text; those are hashed as their UTF-8
    text, which is what the model means and what lockgate sends.
    """
    digest = hashlib.sha256()
    replaced = 0
    for token_id in range(n_vocab):
        piece = token_to_piece(vocab, token_id, special)
        if piece.startswith(b"[UNK_BYTE_0x"):
            piece = llama_cpp.llama_vocab_get_text(vocab, token_id)
            replaced += 1
        digest.update(struct.pack("<I", len(piece)) + piece)
    return digest.hexdigest(), replaced


def main() -> None:
    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        sys.exit(f"llama-cpp-python {llama_cpp.__version__}, not {LLAMA_CPP_PYTHON_VERSION}")
    models = reference_models_dir()
    golden = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "vocabs": {}}
    scratch = pathlib.Path(tempfile.mkdtemp())
    # no vectors of its own: Llama 2's texts, without a space prefix
    CHATS[GEMMA3_STYLE] += [t.text for t in read_vocab_tests(models / "ggml-vocab-llama-spm.gguf")]
    for name in VOCABS:
        if name == GEMMA3_STYLE:
            path = write_gemma3_style_vocab(scratch / f"{name}.gguf")
        else:
            path = models / f"ggml-vocab-{name}.gguf"
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        model, vocab = llm._model, llm._model.vocab
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        texts = [token_to_piece(vocab, i, True).decode("utf-8", "replace") for i in range(n_vocab)]
        control = [
            texts[i] for i in range(n_vocab)
            if model.token_get_attr(i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        ]
        user = [
            texts[i] for i in range(n_vocab)
            if model.token_get_attr(i) & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
            and not texts[i].startswith("[PAD")
        ]
        fill = {f"c{i}": control[i % len(control)] for i in range(3)}
        fill.update({f"u{i}": user[i] if i < len(user) else "" for i in range(2)})
        prompts = []
        for text in CHATS.get(name, []) + [t.format(**fill) for t in GENERIC]:
            data = text.encode()
            prompts.append({
                "text": text,
                "ids": llm.tokenize(data, add_bos=False, special=True),
                "ids_add_special": llm.tokenize(data, add_bos=True, special=True),
            })
        pieces, unk_byte_pieces = piece_hash(vocab, n_vocab, special=True)
        golden["vocabs"][name] = {
            "n_vocab": n_vocab,
            "end_of_generation": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
            "pieces": pieces,
            "unk_byte_pieces": unk_byte_pieces,
            "pieces_no_special": piece_hash(vocab, n_vocab, special=False)[0],
            "prompts": prompts,
        }
        llm.close()
    sys.stdout.write(dumps(golden))


def dumps(golden: dict) -> str:
    """JSON with one prompt a line, so that a change shows as a short diff."""
    def compact(value) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = ["{", f' "llama_cpp_python": {compact(golden["llama_cpp_python"])},', ' "vocabs": {']
    names = list(golden["vocabs"])
    for n, name in enumerate(names):
        vocab = golden["vocabs"][name]
        lines.append(f"  {compact(name)}: {{")
        for key in ("n_vocab", "end_of_generation", "pieces", "unk_byte_pieces", "pieces_no_special"):
            lines.append(f"   {compact(key)}: {compact(vocab[key])},")
        lines.append('   "prompts": [')
        prompts = vocab["prompts"]
        for i, prompt in enumerate(prompts):
            lines.append("    " + compact(prompt) + ("," if i < len(prompts) - 1 else ""))
        lines.append("   ]")
        lines.append("  }" + ("," if n < len(names) - 1 else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
