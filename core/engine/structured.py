"""Structured output at run time: the per-sequence matchers that say which
tokens may come next, from a `Grammar` compiled in the request pipeline
(`lockgate.plugin_api.grammars`, where schemas and tool-call grammars are
compiled and checked before any response byte is sent).

The engine asks `Grammar.matcher()` for one `Matcher` per generated sequence
and, at every step, masks that sequence's logits row with
`Matcher.allowed`, samples, and feeds the token back through
`Matcher.accept`.
"""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.numpy
import numpy as np

__all__ = ["Grammar", "Matcher", "MatcherError"]


class MatcherError(RuntimeError):
    """The matcher cannot go on (llguidance hit one of its parser limits).

    Not the client's fault and not a bad schema: the sequence it belongs to
    has to be failed.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"structured output failed: {reason}")
        #: llguidance's own account
        self.reason = reason


class Grammar:
    """A compiled `response_format`: immutable, shared by every choice of a
    request. Each generated sequence gets its own `matcher()`."""

    __slots__ = ("_eos_token_ids", "_source", "_template", "_vocab_size", "_warnings")

    def __init__(
        self,
        template: llguidance.LLMatcher,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        warnings: tuple[str, ...],
        source: str,
    ) -> None:
        # never advanced: only copied, so it stays at the start of the grammar
        self._template = template
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._warnings = warnings
        self._source = source

    @property
    def source(self) -> str:
        """The llguidance grammar text this was compiled from: what another
        process (a Ray replica) rebuilds it from with `rebuild_grammar`."""
        return self._source

    @property
    def vocab_size(self) -> int:
        """How many token ids the grammar knows; higher ids are never allowed."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end the output (allowed where it may end)."""
        return self._eos_token_ids

    @property
    def warnings(self) -> tuple[str, ...]:
        """What llguidance ignored in a non-strict schema, in its words."""
        return self._warnings

    @property
    def unenforced(self) -> tuple[str, ...]:
        """The keywords of a non-strict schema that change what is valid but
        that generation does not enforce (`'uniqueItems'`, `the string
        format 'binary'`): the warning the request's log line gives."""
        return tuple(k for w in self._warnings for k in (_unenforced_keywords(w) or [w]))

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar, for one sequence."""
        # a copy shares the compiled grammar, so this costs microseconds
        return Matcher(self._template.deep_copy(), self._vocab_size, self._eos_token_ids)


class Matcher:
    """Where one generated sequence stands in its grammar.

    Per decode step: `allowed(width)`, mask
    the logits, sample, `accept(token)`; stop with finish_reason "stop"
    once `is_finished`. Not thread-safe: one sequence, one thread.
    """

    __slots__ = ("_eos_token_ids", "_matcher", "_vocab_size", "_words")

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        # llguidance writes one bit per token into 32-bit words; reused each step
        self._words = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def allowed(self, width: int) -> np.ndarray:
        """Which of `width` token ids may come next, as a bool array.

        `width` is the logits row's length, which may exceed the
        tokenizer's vocabulary (padding): those extra ids are never allowed.
        An EOS id is allowed exactly when the output may end here.

        :raises MatcherError: the matcher hit an llguidance limit.
        """
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._words)
        self._check()
        mask = np.empty(width, dtype=bool)
        _unpack_into(self._words[0], self._vocab_size, mask)
        return mask

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token.

        :raises ValueError: the token was not allowed here; the matcher is
            left as it was.
        """
        token_id = int(token_id)
        if self._matcher.is_stopped():
            # Complete output: llguidance's mask offers EOS, but its
            # try_consume_tokens refuses it, so check against the EOS ids.
            allowed = token_id in self._eos_token_ids and not self._matcher.is_error()
        else:
            # try_consume_tokens, unlike consume_token, leaves the matcher
            # usable when it refuses a token
            allowed = 0 <= token_id < self._vocab_size and (
                self._matcher.try_consume_tokens([token_id]) == 1
            )
        if not allowed:
            raise ValueError(f"token {token_id} is not allowed by the grammar here")

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: it may end here (EOS is allowed)."""
        return self._matcher.is_accepting()

    def forced_tokens(self) -> list[int]:
        """The tokens that must come next whatever the model says: the
        text the grammar forces from here, as llguidance tokenizes it (the
        sampler may draw another tokenization of the same text)."""
        if self._matcher.is_stopped() or self._matcher.is_error():
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing but EOS can follow: stop now."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on, or None."""
        return self._matcher.get_error() or None

    def _check(self) -> None:
        if self._matcher.is_error():
            raise MatcherError(_first_line(self._matcher.get_error()))


def _unpack_into(words: np.ndarray, vocab_size: int, mask_row: np.ndarray) -> None:
    # Bit j of word k is token 32*k + j. Read as bytes on a little-endian
    # host, that is numpy's little bit order.
    known = min(vocab_size, mask_row.shape[0])
    bits = np.unpackbits(words.view(np.uint8), count=known, bitorder="little")
    mask_row[:known] = bits.view(bool)
    mask_row[known:] = False


#: llguidance's words for a keyword it does not implement (a warning when
#: lenient, the error when strict), and what the client wrote
_UNENFORCED = (
    (re.compile(r"Unimplemented keys: \[([^\]]*)\]"), lambda m: [f"'{k}'" for k in json.loads(f"[{m[1]}]")]),
    (re.compile(r"Unknown format: (.*)"), lambda m: [f"the string format '{m[1].strip()}'"]),
    (re.compile(r"oneOf constraints are not supported"), lambda m: ["'oneOf' with branches that may overlap"]),
    (re.compile(r"min/maxProperties only supported when"),
     lambda m: ["'minProperties'/'maxProperties' on an object whose properties are not all required"]),
)


def _unenforced_keywords(message: str) -> list[str]:
    """The keywords a message of llguidance's names as not enforced."""
    for pattern, named in _UNENFORCED:
        match = pattern.search(message)
        if match:
            try:
                return named(match)
            except ValueError:
                return [match[0]]
    return []


def _first_line(text: str) -> str:
    # non-verbose llguidance errors still end in a "<non-verbose/>" line
    return text.strip().splitlines()[0] if text.strip() else text
