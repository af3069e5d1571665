"""The model's tokenizer, built from a GGUF file's metadata alone.

llama.cpp's converter stores a tokenizer as plain arrays (`tokenizer.ggml.tokens`,
`.token_type`, `.scores`, `.merges`) plus the name of its kind
(`tokenizer.ggml.model`) and, for byte-level BPE, of the pre-tokenizer
(`tokenizer.ggml.pre`), whose split rules live in llama.cpp's source rather
than in the file. This module rebuilds the tokenizer llama.cpp runs for those
arrays with the `tokenizers` package and wraps it as a `TextTokenizer`
(transformers' familiar API, without transformers). Three kinds are
supported:

- ``gpt2``: byte-level BPE (Llama 3, Qwen2/2.5/3, Mistral Nemo's tekken,
  SmolLM, StarCoder, DeepSeek, Command-R, Falcon, MPT, GPT-2), with the
  pre-tokenizers in `SUPPORTED_PRE_TOKENIZERS`;
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral 7B,
  Phi-3, Gemma 1-3);
- ``gemma4``: Gemma 4's BPE over SentencePiece-style text.

The SentencePiece kinds' BPE model (the vocabulary, the merges recovered
from the scores or read from the file, byte fallback) is the one
transformers' GGUF tokenizer converter builds; everything around it follows
llama.cpp (`src/llama-vocab.cpp`), where the converter does otherwise.

The test vectors llama.cpp ships with its vocabularies check all of this
(`tests/unit/models/test_tokenizer_vectors.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from lockgate.errors import ModelLoadError
from lockgate.models.pre_tokenizers import PRE_TOKENIZERS, SUPPORTED_PRE_TOKENIZERS, PreTokenizerSpec
from lockgate.models.text_tokenizer import TextTokenizer

__all__ = [
    "eos_token_ids",
    "load_tokenizer",
    "SUPPORTED_PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
]

_BYTE_LEVEL, _SENTENCEPIECE, _GEMMA4 = "gpt2", "llama", "gemma4"

SUPPORTED_TOKENIZER_MODELS: tuple[str, ...] = (_GEMMA4, _BYTE_LEVEL, _SENTENCEPIECE)
"""The `tokenizer.ggml.model` values `load_tokenizer` understands."""

# Token types as llama.cpp's converter writes them (gguf.TokenType).
_TYPE_NORMAL = int(gguf.TokenType.NORMAL)
_TYPE_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_TYPE_CONTROL = int(gguf.TokenType.CONTROL)
_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# --- Tokens llama.cpp recognises by their text (llama_vocab::impl::load) -----------------------

# Texts that end generation wherever they are in the vocabulary.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]",
        "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)
# Fill-in-the-middle tokens: llama.cpp treats them as control tokens, and the
# padding, repository and file-separator ones also end generation.
_FIM_PREFIX_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                     "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUFFIX_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                     "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MIDDLE_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                     "▁<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REPO_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEPARATOR_TEXTS = ("<|file_sep|>",)
_ENDING_FIM = (
    ("tokenizer.ggml.fim_pad_token_id", _FIM_PAD_TEXTS),
    ("tokenizer.ggml.fim_rep_token_id", _FIM_REPO_TEXTS),
    ("tokenizer.ggml.fim_sep_token_id", _FIM_SEPARATOR_TEXTS),
)
_CONTROL_LOOKING_TEXTS = END_OF_GENERATION_TEXTS.union(
    _FIM_PREFIX_TEXTS, _FIM_SUFFIX_TEXTS, _FIM_MIDDLE_TEXTS, _FIM_PAD_TEXTS, _FIM_REPO_TEXTS,
    _FIM_SEPARATOR_TEXTS,
)

def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_id(reader, key: str, n_vocab: int) -> int | None:
    value = _scalar(reader, key)
    if value is None:
        return None
    value = int(value)
    # llama.cpp ignores an out-of-range special id (with a warning); so do we.
    return value if 0 <= value < n_vocab else None


def _end_of_generation(reader, token_ids: Mapping[str, int], n_vocab: int) -> list[int]:
    """The ids llama.cpp's `special_eog_ids` holds, EOS first, then by id.

    llama.cpp picks one token per fill-in-the-middle role when several texts
    of a role are in the vocabulary; no vocabulary we know has two, and this
    takes them all.
    """
    found: set[int] = set()
    for key, texts in _ENDING_FIM:
        token_id = _token_id(reader, key, n_vocab)
        if token_id is not None:
            found.add(token_id)
        else:
            found.update(token_ids[t] for t in texts if t in token_ids)
    found.update(token_ids[t] for t in END_OF_GENERATION_TEXTS if t in token_ids)
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", n_vocab)
    for token_id in (
        eos,
        _token_id(reader, "tokenizer.ggml.eot_token_id", n_vocab),
        _token_id(reader, "tokenizer.ggml.eom_token_id", n_vocab),
    ):
        if token_id is not None:
            found.add(token_id)
    texts = {text for text, token_id in token_ids.items() if token_id in found}
    # gpt-oss (harmony) and Solar Open end a message with <|end|> but go on
    # after it; llama.cpp takes it off the list when their markers are there.
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        found.discard(token_ids["<|end|>"])
    # Gemma 4 and PLaMo have an ordinary "</s>".
    if "</s>" in texts and ({"<|tool_response>", "<|plamo:eos|>"} & texts):
        found.discard(token_ids["</s>"])
    ordered = sorted(found)
    if eos is not None and eos in found:
        ordered.remove(eos)
        ordered.insert(0, eos)
    return ordered


def load_tokenizer(reader, *, chat_template: str | None = None) -> TextTokenizer:
    """Build the model's tokenizer from the metadata of an open GGUF file.

    Tokens split text as llama.cpp's `llama_tokenize(..., parse_special=True)`
    does: control and unknown tokens (and the ones llama.cpp takes for
    control by their text, such as `<|im_end|>` or `<end_of_turn>`) become
    special tokens, user-defined tokens are matched whole but are not
    special. Encoding with special tokens adds BOS as llama.cpp does
    (`tokenizer.ggml.add_bos_token`, else the kind's default). Decoding a
    sequence gives the concatenation of its tokens' texts, a SentencePiece
    token's leading space included (what llama.cpp's server sends).

    :param reader: the open GGUF file (`GGUFMetadata` or `gguf.GGUFReader`).
    :param chat_template: a Jinja chat template that replaces the file's
        `tokenizer.chat_template` (the `--chat-template` option).
    :returns: a `TextTokenizer` whose `chat_template` is the
        override if given, else the file's template (None if it has none),
        and whose `named_chat_templates` maps the names of the file's named
        templates (`tokenizer.chat_template.<name>`) to their text (none
        with an override).
    :raises ModelLoadError: the file has no tokenizer, or one of a kind or
        pre-tokenizer this loader does not implement.
    """
    kind = _scalar(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model); lockgate loads "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece) and 'gemma4'"
        )
    spec = None
    if kind == _BYTE_LEVEL:
        pre = _scalar(reader, "tokenizer.ggml.pre")
        spec = PRE_TOKENIZERS.get(pre) if pre is not None else None
        if spec is None:
            raise ModelLoadError(
                f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
                + ", ".join(SUPPORTED_PRE_TOKENIZERS)
            )

    tokens = _scalar(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF metadata lacks the token list (tokenizer.ggml.tokens)")
    token_types = _scalar(reader, "tokenizer.ggml.token_type") or [_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    # llama.cpp renames empty tokens so that every id keeps a distinct text.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    token_ids = {text: i for i, text in enumerate(tokens)}
    if len(token_ids) != len(tokens):
        raise ModelLoadError("tokenizer.ggml.tokens holds the same text twice")
    n_vocab = len(tokens)

    if kind == _BYTE_LEVEL:
        backend = _byte_level_backend(reader, token_ids, spec)
    else:
        backend = _sentencepiece_backend(reader, kind, tokens)
    backend.add_tokens(_added_tokens(reader, tokens, token_types, token_ids))

    special = {}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = _token_id(reader, key, n_vocab)
        special[name] = tokens[token_id] if token_id is not None else None
    if kind == _BYTE_LEVEL:
        add_bos = _scalar(reader, "tokenizer.ggml.add_bos_token", spec.default_add_bos)
    else:
        add_bos = _scalar(reader, "tokenizer.ggml.add_bos_token", True)
    if kind == _GEMMA4:
        # llama.cpp forces BOS on for Gemma 4 whatever the file says
        # (ggml-org/llama.cpp#21500); its chat template writes <bos> itself,
        # and chat prompts are encoded without special tokens.
        add_bos = True
    add_eos = bool(_scalar(reader, "tokenizer.ggml.add_eos_token", False))

    template = chat_template
    named_templates = {}
    if template is None:
        template = _scalar(reader, "tokenizer.chat_template")
        # llama.cpp's named templates (`tokenizer.chat_template.tool_use`
        # beside a plain default, as Hermes and Command-R files carry them);
        # an override replaces them all, as in llama.cpp
        prefix = "tokenizer.chat_template."
        named_templates = {
            key[len(prefix):]: str(_scalar(reader, key)) for key in reader.fields if key.startswith(prefix)
        }
    return TextTokenizer(
        backend,
        special_tokens=special,
        add_bos_token=bool(add_bos),
        add_eos_token=add_eos,
        # Clean-up would drop spaces before punctuation, so a decoded text
        # would not round-trip and a streamed text could differ from the
        # whole decode; llama.cpp's server does not clean up either.
        clean_up_tokenization_spaces=False,
        chat_template=template,
        # beside `chat_template`, which stays the default's text: the chat
        # template plugin picks `tool_use` when tools are offered
        named_chat_templates=named_templates,
    )


def _byte_level_backend(reader, token_ids: dict[str, int], spec: PreTokenizerSpec) -> Tokenizer:
    """A byte-level BPE model with llama.cpp's split rules.

    Built here rather than by transformers' GGUF converter, whose byte-level
    builder re-spells every token that is not in the byte alphabet (so
    DeepSeek's `<｜User｜>` or MPT's runs of spaces are no longer found by their
    text and get cut into pieces), knows split rules for a few pre-types only
    (StarCoder's digits, DeepSeek's, Falcon's are missing) and never sets
    `ignore_merges` (Llama 3's "Cửa Việt" comes out in five tokens, not three).
    """
    merges = _scalar(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError("GGUF metadata lacks the BPE merges (tokenizer.ggml.merges)")
    pairs = [_merge_pair(merge) for merge in merges]
    backend = Tokenizer(models.BPE(vocab=token_ids, merges=pairs, ignore_merges=spec.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(reader, kind: str, tokens: list[str]) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback, as llama.cpp runs it.

    The BPE model is the one transformers' GGUF converter builds: for
    "llama" files the merges are recovered from the scores (llama.cpp merges
    the adjacent pair whose joined text has the best score, which ranks the
    same), for "gemma4" files they are read. Around it, llama.cpp's rules
    rather than the converter's:

    - a space is added in front of every run of text between special tokens
      when `tokenizer.ggml.add_space_prefix` (the default for "llama") says
      so, then spaces become "▁". The converter uses `Metaspace`, which adds
      no "▁" to a text that starts with a space (llama.cpp's " " is [259],
      the converter's [29871]) and only at the start of the whole text; its
      Phi-3 builder has the right normalizer, chosen by architecture;
    - no other splitting, except Gemma 4's: llama.cpp cuts its text at
      newlines and keeps runs of them apart from other text;
    - every file uses its own scores: the converter orders Gemma's merges by
      token position instead and renames its whitespace tokens, which
      llama.cpp matches as user-defined tokens by their text;
    - decoding keeps the first token's leading space (what llama.cpp's
      server sends), where the converter's decoder strips it.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    scores = _scalar(reader, "tokenizer.ggml.scores")
    merges = _scalar(reader, "tokenizer.ggml.merges")
    if merges is not None:
        pairs = [_merge_pair(merge) for merge in merges]
    elif scores is not None and len(scores) >= len(tokens):
        pairs = _merges_from_scores(vocab, scores)
    else:
        raise ModelLoadError(
            "GGUF metadata lacks the scores of a SentencePiece vocabulary (tokenizer.ggml.scores)"
        )
    # Gemma 4's unknown token is "<unk>" by name, as transformers' Gemma class has it
    unk = "<unk>" if kind == _GEMMA4 else None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    if kind == _GEMMA4:
        add_space_prefix = False
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    else:
        add_space_prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    """A `tokenizer.ggml.merges` entry's two sides: llama.cpp splits it at
    the first space after the first character."""
    cut = merge.find(" ", 1)
    if cut < 0 or cut == len(merge) - 1:
        raise ModelLoadError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return merge[:cut], merge[cut + 1 :]


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a
    token into two tokens of the vocabulary, best-scored token first (ties:
    the longer left side, then the longer right side, first; within one
    token, by the ids of its sides), as transformers' `generate_merges`."""
    found = []
    for token, score in zip(vocab, scores):
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda merge: (vocab[merge[0]], vocab[merge[1]]))
        found.extend(local)
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _added_tokens(reader, tokens: list[str], token_types: Sequence[int],
                  token_ids: Mapping[str, int]) -> list[AddedToken]:
    """Tokens matched whole in the text before the model sees it.

    Control and unknown tokens, and every token llama.cpp takes for a control
    token by its text, are special; user-defined ones are not. Phi-3 files
    (by `general.name`) strip the whitespace after them, as llama.cpp does.
    """
    control = {i for i, kind in enumerate(token_types) if kind in (_TYPE_CONTROL, _TYPE_UNKNOWN)}
    control.update(token_ids[t] for t in _CONTROL_LOOKING_TEXTS if t in token_ids)
    control.update(_end_of_generation(reader, token_ids, len(tokens)))
    user_defined = {i for i, kind in enumerate(token_types) if kind == _TYPE_USER_DEFINED}
    if "</s>" in token_ids and ({"<|tool_response>", "<|plamo:eos|>"} & token_ids.keys()):
        control.discard(token_ids["</s>"])  # an ordinary token there (see _end_of_generation)
        user_defined.discard(token_ids["</s>"])
    name = str(_scalar(reader, "general.name", "")).lower()
    rstrip: set[int] = set()
    if "phi-3" in name or "phi3" in name:
        rstrip = (control | user_defined | {token_ids.get("</s>")}) - {
            token_ids.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")
        }
    added = []
    for i in sorted(control | user_defined):
        added.append(
            AddedToken(tokens[i], special=i in control, normalized=False, rstrip=i in rstrip)
        )
    return added


def eos_token_ids(reader, tokenizer: TextTokenizer) -> list[int]:
    """The token ids at which generation stops, EOS first, as llama.cpp's
    end-of-generation set has them.

    EOS, the end-of-turn and end-of-message ids if the file names them
    (`tokenizer.ggml.eot_token_id`, `.eom_token_id`), the tokens whose text
    ends a turn in common chat formats (`<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`, `</s>`, `<|endoftext|>`, …), and the fill-in-the-middle
    padding, repository and file-separator tokens.
    """
    token_ids = tokenizer.get_vocab()
    ids = _end_of_generation(reader, token_ids, len(tokenizer))
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids
