"""What the engine tracks about an admitted request and each of its choices."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from lockgate.engine.detokenizer import IncrementalDetokenizer
from lockgate.engine.pooling import LAST, Pooler
from lockgate.engine.sampling import TokenLogprob, logprobs_of, make_generator
from lockgate.engine.speculation import DraftRecord

if TYPE_CHECKING:
    from lockgate.engine.handle import RequestHandle


class Choice:
    """One generated sequence of a request."""

    def __init__(self, request: "RequestState", index: int, tokenizer) -> None:
        self.request = request
        self.index = index
        #: the executor's sequence id, or -1 while the choice holds no KV
        self.seq_id = -1
        #: tokens of prompt + output already in the KV cache
        self.kv_len = 0
        self.output_ids: list[int] = []
        params = request.params
        # a pooled request's choice writes no text
        self.detokenizer = None if request.work.pooling is not None else IncrementalDetokenizer(
            tokenizer, request.prompt_ids, stop=params.stop, skip_special_tokens=params.skip_special_tokens
        )
        self._rng: np.random.Generator | None = None
        self.matcher = None if params.grammar is None else params.grammar.matcher()
        self.finished = False
        #: tokens the KV sequence holds while a speculative step verifies
        #: drafts past `kv_len` (the scheduler truncates to `kv_len` after)
        self.kv_held: int | None = None

    @property
    def rng(self) -> np.random.Generator:
        """The choice's random stream, made when first drawn from: greedy
        choices never draw, and seeding a generator from the system's
        entropy costs more than a whole engine step spends on a token."""
        if self._rng is None:
            self._rng = make_generator(self.request.params, self.index)
        return self._rng

    def tokens(self) -> list[int]:
        """Prompt and output so far: what the choice's KV sequence is to hold."""
        return [*self.request.prompt_ids, *self.output_ids]

    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt's rest, or the last sampled token."""
        prompt = self.request.prompt_ids
        if self.kv_len < len(prompt):
            return [*prompt[self.kv_len :], *self.output_ids]
        return self.output_ids[self.kv_len - len(prompt) :]

    def pending_count(self) -> int:
        """How many tokens `pending` holds, without building it."""
        return len(self.request.prompt_ids) + len(self.output_ids) - self.kv_len

    def next_pending(self) -> int:
        """The first of the `pending` tokens (the one a decode row carries)."""
        prompt = self.request.prompt_ids
        if self.kv_len < len(prompt):
            return prompt[self.kv_len]
        return self.output_ids[self.kv_len - len(prompt)]


class RequestState:
    """An admitted request: its choices and where it stands.

    It starts with one choice; the other `n - 1` are forked from it once the
    prompt is in the KV cache, so they share the prompt's pages.
    """

    def __init__(self, handle: "RequestHandle", tokenizer) -> None:
        self.handle = handle
        self.work = handle.work
        self.request_id = handle.work.request_id
        self.params = handle.work.params
        self.prompt_ids = handle.work.prompt_token_ids
        #: the prompt as an array, for prefix matching
        self.prompt_array = np.asarray(self.prompt_ids, dtype=np.int64)
        self.max_tokens = handle.max_tokens
        self.tokenizer = tokenizer
        self.choices: list[Choice] = [Choice(self, 0, tokenizer)]
        #: the `n - 1` other choices exist (created by forking the first)
        self.forked = self.params.n == 1
        self.arrived_at = time.monotonic()
        self.first_token_at: float | None = None
        self.preemptions = 0
        #: finished, failed or aborted, as the engine thread sees it
        self.done = False
        #: the prompt tokens' logprobs found so far, when asked for: entry `q`
        #: is token `q`'s given the ones before it (the first has none)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if self.params.prompt_logprobs is None else [None]
        )
        #: its choices' speculative drafts, proposed and accepted
        self.drafts = DraftRecord()
        #: what folds the prompt's hidden states, for a pooled request
        self.pooler = None if handle.work.pooling is None else Pooler(handle.work.pooling)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here, none of it
        read from the prefix cache: for its prompt logprobs, or for a
        pooling that reads every position's hidden state."""
        return self.wants_prompt_logprobs or (self.pooler is not None and self.pooler.pooling != LAST)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt positions still need their logprobs: a prefill of
        this request's prompt must return every position's logits (and its
        prompt cannot come from the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def note_prompt_logprobs(self, start: int, logits, first_row: int, count: int) -> None:
        """Take the prompt logprobs a prefill chunk's rows give: the chunk
        starts at position `start`, and its row `j` (logits row `first_row +
        j`) is the distribution of the token at position `start + j + 1`."""
        found = self.prompt_logprobs
        first = len(found)  # the first position still without one
        last = min(start + count, len(self.prompt_ids) - 1)
        if first < start + 1:
            raise RuntimeError(f"prompt logprobs from position {first} missing, the chunk starts at {start}")
        positions = range(first, last + 1)
        found += logprobs_of(
            logits, [first_row + q - start - 1 for q in positions], [self.prompt_ids[q] for q in positions],
            self.params.prompt_logprobs,
        )

    @property
    def live_choices(self) -> list[Choice]:
        return [c for c in self.choices if not c.finished]

    @property
    def slots(self) -> int:
        """Sequence slots this request occupies (or will, once forked)."""
        return self.params.n if not self.forked else len(self.live_choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices)

    def latencies(self) -> tuple[float | None, float | None]:
        """Seconds from arrival to the first token, and the mean seconds per
        token after each choice's first (None where there is none)."""
        if self.first_token_at is None:
            return None, None
        later_tokens = self.completion_tokens - len(self.choices)
        tpot = (time.monotonic() - self.first_token_at) / later_tokens if later_tokens > 0 else None
        return self.first_token_at - self.arrived_at, tpot

    def new_choices(self) -> list[Choice]:
        """The `n - 1` choices that fork from the first."""
        return [Choice(self, index, self.tokenizer) for index in range(1, self.params.n)]
