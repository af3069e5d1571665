"""Speculative decoding without a second model: drafts, and when to use them.

A drafter proposes the tokens a choice is likely to generate next; the
engine then runs the choice's last token and the drafts through one
executor call, which returns the logits after each, and samples them in
order with the choice's own random stream, penalties and grammar as a
decode step would: every draft the sampler draws as drafted is accepted,
the first token it draws otherwise is the step's last, and the rejected
drafts are truncated from the KV cache. The output is therefore the
output without speculation: on the CPU, where a token prefilled and a
token decoded compute the same bits, a greedy or seeded request gives the
same tokens with speculation on or off.

The built-in drafters, asked in this order (`DEFAULT_DRAFTERS`), each
proposing nothing where it has nothing:

* `prediction`: OpenAI's Predicted Outputs: the text the request says the
  answer will largely be, from where the output has got to in it;
* `grammar`: the tokens a grammar leaves no choice about (JSON keys, a
  tool call's envelope), which the sampler will draw whatever the model says;
* `prompt_lookup`: the tokens that followed the longest recent n-gram of the
  sequence (prompt and output) where it occurred earlier in it;
* `ngram_memory`: the same, over what the server generated for earlier
  requests (an agent's tool outputs come back in its next prompt).

`SpeculationPolicy` decides per step how many drafts to verify: the number
that makes the most tokens a second, from each request's acceptance so far
and what decode steps and verifications measured on this executor cost;
and only while the decode batch is small (a draft costs a row, which a
large batch pays in full).

A plugin adds a drafter through `lockgate_register_drafters`.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from lockgate.engine.state import Choice

#: the longest n-gram the lookups match
MAX_NGRAM = 4
#: the shortest: a single repeated token drafts too much that is wrong
MIN_NGRAM = 2


@dataclasses.dataclass
class DraftContext:
    """What a drafter sees of one choice."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    #: the request's predicted output, as token ids (empty: none)
    prediction: Sequence[int] = ()
    #: the choice's grammar matcher (None: unconstrained)
    matcher: object | None = None

    def tokens(self) -> np.ndarray:
        return np.asarray([*self.prompt_ids, *self.output_ids], dtype=np.int64)


class Drafter(abc.ABC):
    """Proposes a choice's next tokens. One instance serves the engine:
    `propose` is called from the engine thread only."""

    #: the name `--drafters` and the metrics use
    name: ClassVar[str]

    @abc.abstractmethod
    def propose(self, context: DraftContext, k: int) -> list[int]:
        """At most `k` tokens the choice is likely to generate next (none:
        nothing to propose)."""

    def learn(self, tokens: Sequence[int]) -> None:
        """A finished sequence's tokens (prompt and output), to draw on later."""


def _continuation(haystack: np.ndarray, tail: np.ndarray, k: int, *, before: int, near: int | None) -> list[int]:
    """The `k` tokens after an occurrence of `tail` in `haystack[:before]`
    (one that ends before `before`): the last, or the one that ends
    nearest `near`; none where it does not occur."""
    n = len(tail)
    if n == 0 or before < n:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(haystack[:before], n)
    hits = np.flatnonzero((windows == tail).all(axis=1))
    if not hits.size:
        return []
    hit = hits[-1] if near is None else hits[np.abs(hits + n - near).argmin()]
    start = int(hit) + n
    return haystack[start:start + k].tolist()


def lookup(haystack: np.ndarray, suffix_of: np.ndarray, k: int, *, before: int | None = None,
           near: int | None = None) -> list[int]:
    """The continuation, in `haystack`, of the longest n-gram
    (`MAX_NGRAM` down to `MIN_NGRAM`) that ends `suffix_of` (where it occurs
    more than once: the last occurrence, or the one ending nearest `near`)."""
    before = len(haystack) if before is None else before
    for n in range(min(MAX_NGRAM, len(suffix_of)), MIN_NGRAM - 1, -1):
        found = _continuation(haystack, suffix_of[-n:], k, before=before, near=near)
        if found:
            return found
    return []


class PromptLookup(Drafter):
    """The longest recent n-gram of the sequence, found earlier in it,
    proposes the tokens that followed (vLLM's n-gram speculation)."""

    name = "prompt_lookup"

    def propose(self, context: DraftContext, k: int) -> list[int]:
        tokens = context.tokens()
        # an occurrence that ends before the sequence's own last n-gram does
        return lookup(tokens, tokens, k, before=len(tokens) - 1)


class NgramMemory(Drafter):
    """The same lookup over the sequences the server finished before,
    shared by every request: an index from each n-gram of the last
    `capacity` tokens learned to the tokens that followed its latest
    occurrence, so a lookup costs a few dictionary reads whatever the
    memory holds. The oldest sequences go first."""

    name = "ngram_memory"

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._sequences: collections.deque[tuple[int, ...]] = collections.deque()
        self._held = 0
        #: n-gram -> (the sequence's number, where its continuation starts)
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._first = 0  # the number of the oldest sequence held

    def learn(self, tokens: Sequence[int]) -> None:
        sequence = tuple(int(t) for t in tokens[-self.capacity:])
        if len(sequence) <= MIN_NGRAM:
            return
        number = self._first + len(self._sequences)
        self._sequences.append(sequence)
        self._held += len(sequence)
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            for end in range(n, len(sequence)):
                self._index[sequence[end - n:end]] = (number, end)
        while self._held > self.capacity:
            self._forget()

    def _forget(self) -> None:
        """Drop the oldest sequence, and the n-grams whose latest occurrence it held."""
        oldest = self._sequences.popleft()
        self._held -= len(oldest)
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            for end in range(n, len(oldest)):
                ngram = oldest[end - n:end]
                if self._index.get(ngram, (None,))[0] == self._first:
                    del self._index[ngram]
        self._first += 1

    def propose(self, context: DraftContext, k: int) -> list[int]:
        if not self._sequences:
            return []
        tokens = [*context.prompt_ids[-MAX_NGRAM:], *context.output_ids[-MAX_NGRAM:]][-MAX_NGRAM:]
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            found = self._index.get(tuple(tokens[-n:]))
            if found is None:
                continue
            number, start = found
            return list(self._sequences[number - self._first][start:start + k])
        return []


class PredictionDrafter(Drafter):
    """OpenAI's Predicted Outputs: where the output stands in the predicted
    text (the continuation of its last n-gram there, the occurrence nearest
    the output's own length where there are several; the prediction's
    start while the output is shorter than an n-gram), the tokens that come
    next in it."""

    name = "prediction"

    def propose(self, context: DraftContext, k: int) -> list[int]:
        prediction = np.asarray(context.prediction, dtype=np.int64)
        if not prediction.size:
            return []
        output = np.asarray(context.output_ids, dtype=np.int64)
        if len(output) < MIN_NGRAM:
            if (prediction[: len(output)] == output).all():
                return prediction[len(output):len(output) + k].tolist()
            return []
        # an edited copy of the prediction stays near its own place in it
        return lookup(prediction, output, k, near=len(output))


class GrammarForced(Drafter):
    """The tokens a choice's grammar forces from where it stands: the
    sampler draws them whatever the logits, so they are accepted."""

    name = "grammar"

    def propose(self, context: DraftContext, k: int) -> list[int]:
        matcher = context.matcher
        if matcher is None:
            return []
        return matcher.forced_tokens()[:k]


#: the built-in drafters, in the order the engine asks them
DEFAULT_DRAFTERS: tuple[type[Drafter], ...] = (PredictionDrafter, GrammarForced, PromptLookup, NgramMemory)


#: most drafts a step verifies per choice when k is chosen by measurement
MAX_MEASURED_K = 8


class StepCosts:
    """What a decode step and a verification cost on this executor, as
    measured: a moving average of the seconds of each decode step by batch
    size, and of each verification by the rows it ran (the batch and its
    drafts). A verification not yet measured, or not measured in the last
    `STALE_AFTER` steps, is assumed cheap (a row more costs a tenth of a
    decode step), so the policy tries it and learns its price afresh: a
    first call that paid a one-time cost, or a moment the machine was busy,
    does not keep a k from being used for good."""

    #: how far one measurement moves the average
    WEIGHT = 0.2
    #: what an unmeasured draft row is assumed to add to a decode step
    OPTIMISM = 0.1
    #: steps after which a verification's price is measured again
    STALE_AFTER = 64

    def __init__(self) -> None:
        self.decode: dict[int, float] = {}
        self.verify: dict[int, float] = {}
        self.steps = 0
        #: the step each verification's price was last measured at
        self._measured_at: dict[int, int] = {}

    def observe(self, table: dict[int, float], rows: int, seconds: float) -> None:
        self.steps += 1
        known = table.get(rows)
        if table is self.verify:
            if self._stale(rows):
                known = None
            self._measured_at[rows] = self.steps
        table[rows] = seconds if known is None else known + self.WEIGHT * (seconds - known)

    def _stale(self, rows: int) -> bool:
        return self.steps - self._measured_at.get(rows, -self.STALE_AFTER) >= self.STALE_AFTER

    def decode_step(self, batch: int) -> float:
        if batch in self.decode:
            return self.decode[batch]
        if self.decode:  # the nearest batch measured, scaled by rows
            nearest = min(self.decode, key=lambda b: abs(b - batch))
            return self.decode[nearest] * max(batch, 1) / nearest
        return 1.0

    def verify_step(self, batch: int, rows: int) -> float:
        if rows in self.verify and not self._stale(rows):
            return self.verify[rows]
        return self.decode_step(batch) * (1 + self.OPTIMISM * (rows - batch))


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a step emits for a choice with `drafts` drafts, each accepted
    (after the ones before it) with probability `acceptance`: 1 + p + ... + p^k."""
    return sum(acceptance ** i for i in range(drafts + 1))


@dataclasses.dataclass
class SpeculationPolicy:
    """When to draft, and how much.

    Each step, the drafters propose up to `max_tokens` tokens for each
    decode row; the policy then keeps, of every row's drafts, the first k,
    the k that makes the most tokens a second: each choice's expected
    tokens (its request's acceptance so far) over the step's measured cost
    (`StepCosts`), against a plain decode step. A request whose drafts keep
    being rejected is thus left to decode (its drafts are still checked
    against what the decode step draws, so it speculates again when they
    start to match); an executor whose verification is dear speculates
    only where the acceptance pays for it.

    :param drafters: asked in order; the first that proposes wins.
    :param max_tokens: most drafts per choice a step (k); 0: up to
        `MAX_MEASURED_K`, chosen by measurement.
    :param max_batch: speculate only while the decode batch holds at most
        this many choices.
    :param fixed: always draft `max_tokens` where the drafters have them (no measurement).
    """

    drafters: Sequence[Drafter]
    max_tokens: int = 0
    max_batch: int = 4
    costs: StepCosts = dataclasses.field(default_factory=StepCosts)

    @property
    def fixed(self) -> bool:
        return self.max_tokens > 0

    @property
    def most(self) -> int:
        return self.max_tokens or MAX_MEASURED_K

    def worthwhile(self, batch: int) -> bool:
        return bool(self.drafters) and batch <= self.max_batch

    def draft(self, context: DraftContext, k: int) -> tuple[list[int], str | None]:
        """Drafts for one choice (at most `k`), and the drafter's name."""
        if k <= 0:
            return [], None
        for drafter in self.drafters:
            tokens = drafter.propose(context, k)
            if tokens:
                return [int(t) for t in tokens[:k]], drafter.name
        return [], None

    def choose(self, proposed: list[tuple[list[int], str | None]], acceptance: list[float]) -> int:
        """How many of each row's proposed drafts the step verifies (0: a
        plain decode step)."""
        longest = max((len(tokens) for tokens, _ in proposed), default=0)
        if self.fixed or not longest:
            return longest
        batch = len(proposed)
        best, best_rate = 0, batch / self.costs.decode_step(batch)
        for k in range(1, longest + 1):
            kept = [min(k, len(tokens)) for tokens, _ in proposed]
            tokens = sum(expected_tokens(p, n) for p, n in zip(acceptance, kept))
            rate = tokens / self.costs.verify_step(batch, batch + sum(kept))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def decoded(self, choices: Sequence["Choice"], lengths: Sequence[int], proposed: Sequence[tuple[list[int], str | None]],
                seconds: float) -> None:
        """A plain decode step of `choices` (each `lengths` tokens out
        before it) took `seconds`; what it drew is checked against the
        first draft each was proposed."""
        self.costs.observe(self.costs.decode, len(choices), seconds)
        for choice, length, (tokens, _) in zip(choices, lengths, proposed):
            if tokens and len(choice.output_ids) > length:
                choice.request.drafts.observe(int(choice.output_ids[length] == tokens[0]), 1)

    def verified(self, rows: int, seconds: float) -> None:
        """A verification of `rows` rows (the choices and their drafts) took `seconds`."""
        self.costs.observe(self.costs.verify, rows, seconds)

    def learn(self, tokens: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.learn(tokens)


@dataclasses.dataclass
class DraftRecord:
    """One request's drafts so far (all its choices together)."""

    drafted: int = 0
    accepted: int = 0
    #: of those, the predicted output's (OpenAI's usage fields)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    #: the chance that a draft (after accepted ones) is accepted: a moving
    #: average over recent drafts, verified or checked against a decode step
    acceptance: float = 0.5

    #: how far one draft's outcome moves `acceptance`
    WEIGHT: ClassVar[float] = 0.15

    def note(self, drafter: str | None, drafted: int, accepted: int) -> None:
        """A verification accepted `accepted` of `drafted` drafts."""
        self.drafted += drafted
        self.accepted += accepted
        if drafter == PredictionDrafter.name:
            self.prediction_accepted += accepted
            self.prediction_rejected += drafted - accepted
        self.observe(accepted, drafted)

    def observe(self, accepted: int, tried: int) -> None:
        """`accepted` drafts in a row accepted, then (where fewer than
        `tried`) one rejected."""
        outcomes = [1.0] * accepted + ([0.0] if accepted < tried else [])
        for outcome in outcomes:
            self.acceptance += self.WEIGHT * (outcome - self.acceptance)
