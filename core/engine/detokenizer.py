"""Incremental detokenization of one generated sequence, with stop strings.

Decoding token by token is wrong in two ways: a token may end in the middle
of a UTF-8 character (byte-level vocabularies split emoji and CJK characters
across tokens), and a token's text can depend on its neighbours (a decoder
may drop the leading space of the first token it sees). Decoding the whole
sequence on every step is right but quadratic. `IncrementalDetokenizer`
decodes a short window of recent tokens instead and emits only the part of
the window's text it has not emitted yet, holding back characters that may
still change (an incomplete character) or that may begin a stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tokenizers

__all__ = ["DetokenizerStep", "IncrementalDetokenizer"]

# Lossy UTF-8 decoding turns an incomplete trailing character into U+FFFD;
# the tokens that complete it turn it into the real character.
_REPLACEMENT = "\ufffd"

# Tokens of context kept before the new ones: enough for a decoder to render
# a token's leading space and for any character split over several tokens to
# lie wholly inside the window.
_CONTEXT_TOKENS = 6


def _decoder_of(tokenizer) -> Callable[..., str]:
    """`decode(ids, skip_special_tokens=...)` without clean-up of spaces.

    For a transformers fast tokenizer whose decoding is transformers' own,
    that is exactly its Rust backend's `decode`: called directly, it skips
    transformers' conversion and checking of the ids, which cost more than
    the decoding itself (this runs for every generated token). Anything
    else is asked through its own `decode`.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and _decodes_as_transformers(type(tokenizer)):
        return backend.decode

    def decode(token_ids: list[int], *, skip_special_tokens: bool) -> str:
        return tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


def _decodes_as_transformers(cls: type) -> bool:
    """Whether `cls` decodes with transformers' fast-tokenizer code unchanged."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (
        issubclass(cls, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    )


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizerStep:
    """What one `IncrementalDetokenizer.add` call produced.

    :ivar text: new text that is safe to send now (may be empty).
    :ivar stopped: a stop string was found; `text` ends just before it and
        the sequence is over.
    :ivar stop_string: the stop string that was found, when `stopped`.
    """

    text: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, step by step.

    The text emitted over all `add` calls and the final `finish` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` cut before
    the first stop string, where "first" means the occurrence that is
    complete earliest in the text (for the same end, the longer one). The
    stop string itself is not emitted (OpenAI semantics).

    Each step decodes a window of a bounded number of tokens, so the cost per
    token does not grow with the length of the sequence.

    :param tokenizer: a transformers tokenizer (anything with a compatible
        ``decode``).
    :param prompt_token_ids: the prompt; its last few tokens give the first
        generated token its context (for example its leading space).
    :param stop: stop strings; empty strings are ignored.
    :param skip_special_tokens: drop special tokens from the text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_ids = _decoder_of(tokenizer)
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        # The window: recent tokens, and how many characters of its decoded
        # text are already accounted for (emitted, held for stop matching,
        # or prompt context).
        self._window: list[int] = []
        self._window_done = 0
        # Text that passed the UTF-8 check but may be the start of a stop
        # string, so it is not emitted yet.
        self._pending = ""
        self._stopped = False
        self._finished = False

        seed = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        if seed:
            seed_text = self._decode(seed)
            # A prompt that ends inside a character cannot serve as context:
            # the generated bytes would complete a character the client
            # never sees the start of. Start from a blank window instead.
            if not seed_text.endswith(_REPLACEMENT):
                self._window = seed
                self._window_done = len(seed_text)

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the sequence."""
        return self._stopped

    def add(self, token_id: int, *, stops: bool = True) -> DetokenizerStep:
        """Take the next generated token; return the text now safe to emit.

        With `stops` false (a choice short of its `min_tokens`) no stop
        string is looked for: the text is released as it is, and a stop
        string can only be found in text that comes after it.

        :raises RuntimeError: called after a stop string ended the sequence
            or after `finish`.
        """
        if self._stopped or self._finished:
            raise RuntimeError("IncrementalDetokenizer.add called after the sequence ended")
        self._window.append(int(token_id))
        text = self._decode(self._window)
        # Only a trailing run of replacement characters can still turn into
        # real characters; everything before it is final.
        complete = len(text.rstrip(_REPLACEMENT))
        if complete > self._window_done:
            self._pending += text[self._window_done : complete]
            self._window_done = complete
        self._shrink_window(text)
        if not stops:
            pending, self._pending = self._pending, ""
            return DetokenizerStep(pending)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush the text held back when generation ends for another reason.

        Call it when the sequence ends on EOS, a stop token or the length
        limit; it returns what was held back (an incomplete character is
        decoded as U+FFFD), still cut before any stop string it completes.
        After a stop string it returns "".
        """
        if self._stopped or self._finished:
            return ""
        self._finished = True
        if self._window:
            text = self._decode(self._window)
            self._pending += text[self._window_done :]
            self._window_done = len(text)
        return self._release(final=True).text

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _shrink_window(self, text: str) -> None:
        """Drop old tokens from the window once it is twice the context size.

        The cut is taken only where decoding the kept tokens alone gives
        exactly the end of the window's text and every character before the
        cut is already accounted for; otherwise the window grows by one token
        and the next step tries the next cut.
        """
        if len(self._window) <= 2 * _CONTEXT_TOKENS:
            return
        keep = self._window[-_CONTEXT_TOKENS:]
        tail = self._decode(keep)
        if not tail or tail.startswith(_REPLACEMENT) or not text.endswith(tail):
            return
        dropped = len(text) - len(tail)
        if dropped > self._window_done:
            return
        self._window = keep
        self._window_done -= dropped

    def _release(self, *, final: bool) -> DetokenizerStep:
        """Emit pending text up to a stop string or a possible start of one."""
        pending = self._pending
        if not self._stops:
            self._pending = ""
            return DetokenizerStep(pending)
        found = self._find_stop(pending)
        if found is not None:
            start, stop = found
            self._pending = ""
            self._stopped = True
            return DetokenizerStep(pending[:start], True, stop)
        keep = 0 if final else self._partial_stop_length(pending)
        self._pending = pending[len(pending) - keep :]
        return DetokenizerStep(pending[: len(pending) - keep])

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text`, with its start."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
