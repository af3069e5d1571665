"""A model's tokenizer: a `tokenizers` backend, its special tokens and chat templates.

`TextTokenizer` answers the part of transformers' fast-tokenizer API that
lockgate and its plugins use (`encode`, `decode`, the special tokens and
their ids, `get_vocab`, `added_tokens_decoder`, `convert_ids_to_tokens`,
`apply_chat_template`, `len()`), with the same results: the splitting and
decoding are the same Rust `tokenizers.Tokenizer`, BOS and EOS are added by
the same `TemplateProcessing` post-processor, and templates render as
`lockgate.models.chat_template` renders them. `TokenBytes` gives single
tokens' raw bytes, as llama.cpp's `token_to_piece` does.

It exists for memory (issue 38): importing transformers' tokenizer classes
costs every serving process about 20 MiB resident before a model is read.
`tests/unit/models/test_text_tokenizer.py` holds it to transformers' class
on the same backends.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from lockgate.models.chat_template import pick_template, render_chat_template, templates_by_name

__all__ = ["SPECIAL_TOKEN_NAMES", "TextTokenizer", "TokenBytes"]

#: the named special tokens, as transformers names them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# transformers' `clean_up_tokenization`: spaces before punctuation and contractions
_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
    (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)


class TextTokenizer:
    """A model's tokenizer (see the module's docstring).

    :param backend: the `tokenizers.Tokenizer` that splits and decodes; the
        named special tokens it lacks as added tokens are added to it, as
        special tokens.
    :param special_tokens: the named special tokens' texts
        (`SPECIAL_TOKEN_NAMES`); a name missing or None is not set.
    :param add_bos_token: encoding with special tokens puts BOS first
        (ignored without a BOS token); likewise `add_eos_token` EOS last.
    :param post_processor: whether `add_bos_token` and `add_eos_token` set
        the backend's post-processor. False keeps the backend's own (a
        Hugging Face `tokenizer.json` that brings its own and whose config
        says nothing about BOS); without one, it is set anyway.
    :param chat_template: the default chat template's text, or a mapping of
        names to texts (a Hugging Face config's list of templates).
    :param named_chat_templates: templates by name beside the default (a
        GGUF file's `tokenizer.chat_template.<name>`).
    :param clean_up_tokenization_spaces: whether `decode` drops spaces
        before punctuation by default (off in lockgate: it breaks round
        trips and streaming).
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] = {},
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        post_processor: bool = True,
        chat_template: str | Mapping[str, str] | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        unknown = set(special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"unknown special token names: {', '.join(sorted(unknown))}")
        self.backend_tokenizer = backend
        self._special = {name: str(text) for name, text in special_tokens.items() if text is not None}
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = [text for text in dict.fromkeys(self._special.values()) if text not in added]
        if missing:
            backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in missing])
        self.add_bos_token = bool(add_bos_token) and self.bos_token is not None
        self.add_eos_token = bool(add_eos_token) and self.eos_token is not None
        if post_processor or backend.post_processor is None:
            self._set_post_processor()
        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self.named_chat_templates = dict(named_chat_templates or {})
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

    def _set_post_processor(self) -> None:
        bos = [(self.bos_token, self.bos_token_id)] if self.add_bos_token else []
        eos = [(self.eos_token, self.eos_token_id)] if self.add_eos_token else []
        single = [*(text for text, _ in bos), "$A", *(text for text, _ in eos)]
        pair = [*single, *(text + ":1" for text, _ in bos), "$B:1", *(text + ":1" for text, _ in eos)]
        self.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(bos + eos))
        )

    # ----------------------------------------------------------- special tokens

    def _token(self, name: str) -> str | None:
        return self._special.get(name)

    def _id(self, name: str) -> int | None:
        text = self._special.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    sep_token = property(lambda self: self._token("sep_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    cls_token = property(lambda self: self._token("cls_token"))
    mask_token = property(lambda self: self._token("mask_token"))
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    sep_token_id = property(lambda self: self._id("sep_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))
    cls_token_id = property(lambda self: self._id("cls_token"))
    mask_token_id = property(lambda self: self._id("mask_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, by name."""
        return {name: self._special[name] for name in SPECIAL_TOKEN_NAMES if name in self._special}

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the named special tokens (as transformers 5 has it: not
        every special token of the vocabulary, which `added_tokens_decoder`
        lists)."""
        return list(dict.fromkeys(self._id(name) for name in self.special_tokens_map))

    # ----------------------------------------------------------- vocabulary

    def __len__(self) -> int:
        """Tokens in the vocabulary, added ones included."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Tokens in the base vocabulary, added ones not counted."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        """Every token's text and id, added ones included."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """The tokens matched whole in text, by id."""
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # ----------------------------------------------------------- text

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """`text`'s token ids; with special tokens, BOS and EOS as the
        vocabulary adds them. `split_special_tokens` splits the texts of
        special tokens as any other text (llama.cpp's `parse_special=False`)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes text, not {type(text).__name__}")
        backend = self._splitting_backend() if split_special_tokens else self.backend_tokenizer
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _splitting_backend(self) -> Tokenizer:
        # a copy of its own, made on first use: the flag is the backend's, and
        # flipping it on the shared one would race with other threads' encodes
        found = self.__dict__.get("_splitting")
        if found is None:
            found = copy.copy(self.backend_tokenizer)
            found.encode_special_tokens = True
            self.__dict__["_splitting"] = found
        return found

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of `token_ids`."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """`conversation` rendered with `chat_template` (a template's text or
        name; by default the tokenizer's, `tool_use` where tools are given
        and it has one), the special tokens and `kwargs` in the template's
        reach; its token ids (without BOS added) when `tokenize`. Without
        tools the default is `tool_use` only where that is all there is.

        :raises ValueError: there is no such template.
        """
        template = self._template(chat_template, tools)
        text = render_chat_template(
            template, conversation, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, chat_template: str | None, tools) -> str:
        templates = templates_by_name(self.chat_template, self.named_chat_templates)
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        found = pick_template(templates, tools=tools is not None)
        if found is None:
            raise ValueError("the tokenizer has no chat template")
        return found

    def __repr__(self) -> str:
        return f"TextTokenizer(vocabulary={len(self)}, special={self.special_tokens_map})"


# SentencePiece's byte-fallback tokens.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
    text and bytes even when it holds only part of a UTF-8 character).

    As llama.cpp's `token_to_piece`: a byte-level token's characters map back
    to bytes; a SentencePiece token's "▁" is a space and `<0x0A>` is the byte
    0x0A; control and user-defined tokens are their text.
    """

    _BYTE_OF_CHAR = _gpt2_byte_of_char()

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._added = set(tokenizer.added_tokens_decoder)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        model = getattr(backend, "model", None)
        self._sentencepiece = bool(getattr(model, "byte_fallback", False))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            text = self._tokenizer.convert_ids_to_tokens(token_id)
            if token_id in self._added:
                found = text.encode()
            elif self._sentencepiece:
                byte = _BYTE_TOKEN.fullmatch(text)
                found = bytes([int(byte.group(1), 16)]) if byte else text.replace("▁", " ").encode()
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
