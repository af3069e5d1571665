"""The model's tokenizer, built from a GGUF file's metadata alone.

llama.cpp's converter stores a byte-level BPE tokenizer as plain arrays
(`tokenizer.ggml.tokens`, `.token_type`, `.merges`) plus the name of the
pre-tokenizer (`tokenizer.ggml.pre`), whose split rules live in llama.cpp's
source rather than in the file. This module rebuilds the same tokenizer with
the `tokenizers` package and wraps it as a transformers fast tokenizer, so the
chat template and the rest of the pipeline use the familiar API. It never uses
transformers' own GGUF loader, which imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lockgate.errors import ModelLoadError

__all__ = ["eos_token_ids", "load_tokenizer", "SUPPORTED_PRE_TOKENIZERS", "TokenBytes"]

# GPT-2's split: contractions, letters, numbers, other symbols, each with an
# optional leading space, and runs of whitespace. llama.cpp writes it without
# the final `\s+`; the text that alternative would match is kept as its own
# piece by llama.cpp anyway, so the splits agree.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Llama 3's split: case-insensitive contractions, letters with one leading
# non-letter, numbers in groups of up to three, symbols with trailing
# newlines, then whitespace.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one family of llama.cpp pre-types splits text before BPE."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False
    default_add_bos: bool = False


def _gpt2_pre_tokenizer():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _starcoder_pre_tokenizer():
    # llama.cpp first isolates every single digit, then applies GPT-2's split
    # to what is left (the "smollm" pre-type and its relatives).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _llama3_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_GPT2 = _PreTokenizerSpec(_gpt2_pre_tokenizer)
_STARCODER = _PreTokenizerSpec(_starcoder_pre_tokenizer)
# llama.cpp encodes a whole pre-tokenized word as one token when the word is
# in the vocabulary (ignore_merges), and adds BOS by default for Llama 3.
_LLAMA3 = _PreTokenizerSpec(_llama3_pre_tokenizer, ignore_merges=True, default_add_bos=True)

# `tokenizer.ggml.pre` values, grouped as llama.cpp groups them (same split
# rules), limited to the families whose rules are implemented here.
_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "roberta-bpe": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "codeshell": _STARCODER,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
}

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))
"""The `tokenizer.ggml.pre` values `load_tokenizer` understands."""

# Token types as llama.cpp's converter writes them (gguf.TokenType).
_TYPE_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_TYPE_CONTROL = int(gguf.TokenType.CONTROL)
_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# Texts that llama.cpp also treats as end of generation when they are in the
# vocabulary, whatever the metadata names as EOS.
_END_OF_TURN_TEXTS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|endoftext|>",
)


def _scalar(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_id(reader: gguf.GGUFReader, key: str, n_vocab: int) -> int | None:
    value = _scalar(reader, key)
    if value is None:
        return None
    value = int(value)
    # llama.cpp ignores an out-of-range special id (with a warning); so do we.
    return value if 0 <= value < n_vocab else None


def load_tokenizer(
    reader: gguf.GGUFReader, *, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """Build the model's tokenizer from the metadata of an open GGUF file.

    Supports byte-level BPE vocabularies (`tokenizer.ggml.model` = "gpt2")
    with the pre-tokenizers listed in `SUPPORTED_PRE_TOKENIZERS`. Control
    tokens become special tokens that are never split; user-defined tokens are
    matched whole but are not special. BOS/EOS/UNK/PAD come from the metadata
    ids and `tokenizer.ggml.add_bos_token` decides whether encoding with
    special tokens prepends BOS.

    :param reader: the open GGUF file.
    :param chat_template: a Jinja chat template that replaces the file's
        `tokenizer.chat_template` (the `--chat-template` option).
    :returns: a transformers fast tokenizer whose `chat_template` is the
        override if given, else the file's template (None if it has none).
    :raises ModelLoadError: the file has no tokenizer, or one of a kind or
        pre-tokenizer this loader does not implement.
    """
    model = _scalar(reader, "tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise ModelLoadError(
            f"unsupported tokenizer model {model!r}: lockgate loads byte-level BPE "
            "tokenizers (tokenizer.ggml.model = 'gpt2') only"
        )
    pre = _scalar(reader, "tokenizer.ggml.pre")
    spec = _PRE_TOKENIZERS.get(pre) if pre is not None else None
    if spec is None:
        raise ModelLoadError(
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            + ", ".join(SUPPORTED_PRE_TOKENIZERS)
        )

    tokens = _scalar(reader, "tokenizer.ggml.tokens")
    merges = _scalar(reader, "tokenizer.ggml.merges")
    if not tokens:
        raise ModelLoadError("GGUF metadata lacks the token list (tokenizer.ggml.tokens)")
    if merges is None:
        raise ModelLoadError("GGUF metadata lacks the BPE merges (tokenizer.ggml.merges)")
    token_types = _scalar(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )

    # llama.cpp renames empty tokens so that every id keeps a distinct text.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges))
    backend.pre_tokenizer = spec.build()
    backend.decoder = decoders.ByteLevel()
    added = []
    for i, kind in enumerate(token_types):
        if kind in (_TYPE_CONTROL, _TYPE_UNKNOWN):
            added.append(AddedToken(tokens[i], special=True, normalized=False))
        elif kind == _TYPE_USER_DEFINED:
            added.append(AddedToken(tokens[i], special=False, normalized=False))
    if added:
        backend.add_tokens(added)

    n_vocab = len(tokens)
    special = {}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = _token_id(reader, key, n_vocab)
        # transformers would otherwise invent "<s>"/"</s>" for a missing one.
        special[name] = tokens[token_id] if token_id is not None else None
    add_bos = bool(_scalar(reader, "tokenizer.ggml.add_bos_token", spec.default_add_bos))
    add_eos = bool(_scalar(reader, "tokenizer.ggml.add_eos_token", False))

    template = chat_template
    if template is None:
        template = _scalar(reader, "tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=add_bos and special["bos_token"] is not None,
        add_eos_token=add_eos and special["eos_token"] is not None,
        # Clean-up would drop spaces before punctuation, so a decoded text
        # would not round-trip and a streamed text could differ from the
        # whole decode; llama.cpp does not clean up for these models either.
        clean_up_tokenization_spaces=False,
        chat_template=template,
        **special,
    )


def eos_token_ids(reader: gguf.GGUFReader, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The token ids at which generation stops, EOS first.

    EOS from the metadata, the end-of-turn and end-of-message ids if the file
    names them (`tokenizer.ggml.eot_token_id`, `.eom_token_id`), and the
    control tokens whose text ends a turn in common chat formats
    (`<|im_end|>`, `<|eot_id|>`, `<|end|>`, …), as llama.cpp does.
    """
    ids: list[int] = []
    n_vocab = len(tokenizer)

    def add(token_id: int | None) -> None:
        if token_id is not None and 0 <= token_id < n_vocab and token_id not in ids:
            ids.append(token_id)

    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", n_vocab)
    add(eos if eos is not None else tokenizer.eos_token_id)
    add(_token_id(reader, "tokenizer.ggml.eot_token_id", n_vocab))
    add(_token_id(reader, "tokenizer.ggml.eom_token_id", n_vocab))
    control = {
        token.content: token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special
    }
    for text in _END_OF_TURN_TEXTS:
        add(control.get(text))
    return ids


def _gpt2_byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in chars.items()}


class TokenBytes:
    """The raw bytes of single tokens (for logprobs, which report each token's
    text and bytes even when it holds only part of a UTF-8 character)."""

    _BYTE_OF_CHAR = _gpt2_byte_of_char()

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self._added = set(tokenizer.added_tokens_decoder)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            text = self._tokenizer.convert_ids_to_tokens(token_id)
            if token_id in self._added:
                found = text.encode()
            else:
                try:
                    found = bytes(self._BYTE_OF_CHAR[char] for char in text)
                except KeyError:  # not a byte-level token
                    found = text.encode()
            self._cache[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        """The token's text; bytes that are not whole UTF-8 characters show as U+FFFD."""
        return self(token_id).decode("utf-8", errors="replace")
