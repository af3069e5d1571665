"""How byte-level BPE vocabularies split text before their merges, by
`tokenizer.ggml.pre`, as llama.cpp's `llm_tokenizer_bpe` splits it: the
regexes of each pre-tokenizer family and their flags (`load_tokenizer`
builds its `Split` pre-tokenizers from them)."""

from __future__ import annotations

import dataclasses

# --- Split rules of byte-level BPE, as llama.cpp's llm_tokenizer_bpe has them ------------------
#
# llama.cpp applies a list of regexes in turn, each cutting the pieces the
# previous ones left into matches and the text between them: a `Split` with
# behaviour "isolated" per regex. Where llama.cpp rewrote a tokenizer.json
# regex for std::regex, its rewrite is used (it is what the .out vectors
# hold): `(?i:'s)` spelled out as `'[sS]` (Oniguruma would also fold "'ſ"), and
# tekken's `\p{Lu}`-style classes replaced by lookaheads that count every
# letter outside a-z as upper case and every letter outside A-Z as lower case.

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2: llama.cpp leaves out the final `\s+`; the text that alternative
# would match becomes a piece of its own between matches anyway.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The cased letters of the scripts DeepSeek's tokenizer treats as words, as
# llama.cpp lists them (escaped, so that no editor normalises them).
_DEEPSEEK_LETTERS = (
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# CJK ideographs, U+0800-U+4E00 and Hangul syllables, as llama.cpp has them.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z" + _DEEPSEEK_LETTERS + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    # `$` is the end of the piece: the first rule left no newline inside one
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)


@dataclasses.dataclass(frozen=True)
class PreTokenizerSpec:
    """How one family of llama.cpp pre-types splits text before BPE."""

    #: llama.cpp's `regex_exprs`, applied in order
    splits: tuple[str, ...]
    #: a whole pre-tokenized word that is in the vocabulary is one token
    ignore_merges: bool = False
    #: whether BOS is added when the file does not say (`add_bos_token`)
    default_add_bos: bool = False


_GPT2_SPEC = PreTokenizerSpec((_GPT2,))
_STARCODER_SPEC = PreTokenizerSpec(_STARCODER)
_LLAMA3_SPEC = PreTokenizerSpec((_LLAMA3,), ignore_merges=True, default_add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec((_QWEN2,))

# `tokenizer.ggml.pre` values, grouped as llama.cpp groups them (same split
# rules and flags), limited to the families checked against llama.cpp's test
# vectors or a model file. "gpt2" is not a llama.cpp name but older lockgate
# test files use it.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt2": _GPT2_SPEC,
    "gpt-2": _GPT2_SPEC,
    "phi-2": _GPT2_SPEC,
    "roberta-bpe": _GPT2_SPEC,
    "mpt": _GPT2_SPEC,
    "olmo": _GPT2_SPEC,
    "smollm": _STARCODER_SPEC,
    "starcoder": _STARCODER_SPEC,
    "refact": _STARCODER_SPEC,
    "codeshell": _STARCODER_SPEC,
    "command-r": _STARCODER_SPEC,
    "llama3": _LLAMA3_SPEC,
    "llama-v3": _LLAMA3_SPEC,
    "llama-bpe": _LLAMA3_SPEC,
    "falcon3": _LLAMA3_SPEC,
    "falcon-h1": _LLAMA3_SPEC,
    "pixtral": _LLAMA3_SPEC,
    "dbrx": PreTokenizerSpec((_LLAMA3,)),
    "smaug-bpe": PreTokenizerSpec((_LLAMA3,)),
    "qwen2": _QWEN2_SPEC,
    "deepseek-r1-qwen": _QWEN2_SPEC,
    "stablelm2": _QWEN2_SPEC,
    "megrez": _QWEN2_SPEC,
    "qwen35": PreTokenizerSpec((_QWEN35,)),
    "tekken": PreTokenizerSpec((_TEKKEN,), ignore_merges=True, default_add_bos=True),
    "deepseek-llm": PreTokenizerSpec(_DEEPSEEK_LLM),
    "deepseek-coder": PreTokenizerSpec(_DEEPSEEK_CODER),
    "falcon": PreTokenizerSpec(_FALCON),
}

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(PRE_TOKENIZERS))
"""The `tokenizer.ggml.pre` values `load_tokenizer` understands (byte-level BPE)."""
