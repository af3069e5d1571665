"""Choosing next tokens for a batch: bias, penalties, grammar masks,
temperature, top-k/top-p/min-p, seeded draws, and logprobs.

The work is vectorized over the batch and float32 over the vocabulary;
per-row loops remain only for the sparse adjustments (bias, penalties) and
for top-k/top-p/min-p, which only the rows that ask for them pay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lockgate.engine.params import SamplingParams


def make_generator(params: SamplingParams, choice_index: int) -> np.random.Generator:
    """The random stream of one generated sequence.

    Seeded per choice so the same seed and request give the same output no
    matter which other requests share the batch.
    """
    if params.seed is None:
        return np.random.default_rng()
    return np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, choice_index])


@dataclasses.dataclass
class SamplingRow:
    """What sampling one sequence's next token needs."""

    params: SamplingParams
    #: the choice's random stream; None for a greedy row, which draws nothing
    rng: np.random.Generator | None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    #: allowed tokens (structured output), or None for all
    allowed: np.ndarray | None = None


@dataclasses.dataclass
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    #: the token's rank in its distribution (1: the most likely), where
    #: reported (prompt logprobs)
    rank: int | None = None


def process_logits(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> np.ndarray:
    """Apply logit_bias and the repetition penalties to one row, in place."""
    row = logits
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray([*prompt_ids, *output_ids], dtype=np.int64))
        values = row[seen]
        row[seen] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if len(output_ids) and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        row[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return row


def _needs_processing(params: SamplingParams) -> bool:
    return bool(
        params.logit_bias
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    )


def _plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (
        row.allowed is None
        and params.logprobs is None
        and params.greedy
        and not _needs_processing(params)
    )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sample_batch(
    logits: np.ndarray, rows: Sequence[SamplingRow]
) -> tuple[np.ndarray, list[TokenLogprob | None]]:
    """Sample one token per row of `logits` (shape (len(rows), vocab)).

    Returns the token ids and, for rows whose parameters ask for logprobs,
    the chosen token's log-probability under the model's distribution (before
    any bias, penalty, temperature or filter, as OpenAI reports it) with the
    `top_logprobs` most likely tokens.
    """
    batch = len(rows)
    if logits.dtype == np.float32 and all(_plain_greedy(row) for row in rows):
        # the common case, on every step: nothing to adjust or report
        return np.argmax(logits[:batch], axis=1), [None] * batch
    adjusted = any(_needs_processing(row.params) or row.allowed is not None for row in rows)
    # a copy only for rows to adjust in place; the draw itself writes nothing
    x = np.array(logits[:batch], dtype=np.float32, copy=True if adjusted else None)
    raw_logprobs = {
        i: None for i, row in enumerate(rows) if row.params.logprobs is not None
    }
    if raw_logprobs:
        wanted = np.fromiter(raw_logprobs, dtype=np.int64)
        for i, values in zip(wanted, _log_softmax(x[wanted])):
            raw_logprobs[int(i)] = values
    for i, row in enumerate(rows):
        if _needs_processing(row.params):
            process_logits(x[i], row.params, row.prompt_ids, row.output_ids)
        if row.allowed is not None:
            x[i, ~row.allowed[: x.shape[1]]] = -np.inf
    greedy = np.fromiter((row.params.greedy for row in rows), dtype=bool, count=batch)
    tokens = np.empty(batch, dtype=np.int64)
    if greedy.any():
        tokens[greedy] = np.argmax(x[greedy], axis=1)
    sampled = np.flatnonzero(~greedy)
    if sampled.size:
        tokens[sampled] = _draw(x if sampled.size == batch else x[sampled], [rows[i] for i in sampled])
    logprobs: list[TokenLogprob | None] = [None] * batch
    for i, values in raw_logprobs.items():
        logprobs[i] = _token_logprob(values, int(tokens[i]), rows[i].params.logprobs)
    return tokens, logprobs


#: tokens per block of the two-level draw: a row's mass is summed per block,
#: the block is drawn from those sums, then the token from that one block
_BLOCK = 256

#: bytes of the float32 scratch a wide pass works through (`_block_sums`):
#: as many whole rows as fit, at least one, so the exp and the block sums
#: read it from the core's own cache (2 rows at the default vocabulary;
#: measured 3.5 ms per 64-row step against 5.0 ms with 16 rows, after a
#: model call had evicted the caches)
_SCRATCH_BYTES = 512 * 1024

#: below 1: the largest float64 a uniform in [0, 1) can be
_BELOW_ONE = float(np.nextafter(1.0, 0.0))

#: a row's total mass below this (exp(-20) at the likeliest token and no
#: other mass) is drawn again, shifted by its maximum logit (`_block_sums`)
_SMALLEST_MASS = 2e-9

#: slack, in units of log-probability, of the logit threshold that finds a
#: min-p row's candidates; the exact test is made on their probabilities
_MIN_P_SLACK = 1e-3


def _draw(x: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    """One token per row of `x` (not modified), drawn at the row's
    temperature from what its top-k, min-p and top-p keep.

    Every row takes exactly one `rng.random()` (u) and turns it into the
    first token, in vocabulary order, whose cumulative kept mass exceeds
    u times the row's kept mass. The work is float32 apart from sums:

    * "wide" rows (no top-k, no min-p) pay one pass of exp over the row, a
      few rows at a time, and a sum per block of `_BLOCK` tokens; the
      draw picks the block from the block sums and then the token inside
      that block (the same distribution as one cumulative sum over the
      row). A top-p row among them sorts only the candidates that hold
      top_p of the mass, found by partitioning.
    * "narrow" rows (top-k or min-p) find their few candidates from the
      logits (a partition, or a threshold) and exponentiate only those.
    """
    batch, vocab = x.shape
    temperature = np.fromiter((r.params.temperature for r in rows), dtype=np.float32, count=batch)
    inverse = np.float32(1.0) / temperature
    uniform = np.fromiter((r.rng.random() for r in rows), dtype=np.float64, count=batch)
    tokens = np.empty(batch, dtype=np.int64)
    narrow = np.fromiter(
        (0 < r.params.top_k < vocab or r.params.min_p > 0 for r in rows), dtype=bool, count=batch
    )
    for i in np.flatnonzero(narrow):
        tokens[i] = _draw_narrow(x[i], rows[i].params, inverse[i], uniform[i])
    wide = np.flatnonzero(~narrow)
    if wide.size:
        tokens[wide] = _draw_wide(x, wide, [rows[i].params.top_p for i in wide], inverse[wide], uniform[wide])
    return tokens


def _draw_wide(
    x: np.ndarray, which: np.ndarray, top_p: list[float], inverse: np.ndarray, uniform: np.ndarray
) -> np.ndarray:
    """The draws of rows `which` of `x` (see `_draw`), `inverse` their
    1 / temperature and `uniform` their uniforms.

    A top-p row exponentiates its row once and sorts candidates
    (`_draw_top_p`). For the others the one pass over the vocabulary is
    `_block_sums`; a row's block is then drawn from its block sums and,
    its mass exponentiated again (elementwise, to the same values as were
    summed), the token inside it, vectorized over the rows.
    """
    vocab = x.shape[1]
    rows = x if which.size == x.shape[0] else x[which]
    tokens = np.empty(which.size, dtype=np.int64)
    plain = np.fromiter((p >= 1.0 for p in top_p), dtype=bool, count=which.size)
    for r in np.flatnonzero(~plain):
        # a top-p row's one pass: exp shifted by its maximum, which sorting needs whole
        top = rows[r].max()
        e = np.exp((rows[r] - (top if np.isfinite(top) else np.float32(0))) * inverse[r])
        tokens[r] = _draw_top_p(e, float(e.sum(dtype=np.float64)), top_p[r], uniform[r])
    p = np.flatnonzero(plain)
    if p.size:
        if p.size < which.size:
            rows, inverse = rows[p], inverse[p]
        block_sums, shift = _block_sums(rows, inverse)
        u = uniform[p]
        block = _first_above(block_sums, u)
        # where the draw fell inside the chosen block's mass, as a fraction
        # of it: again uniform in [0, 1), and it picks the token there
        cumulative = np.cumsum(block_sums, axis=1, dtype=np.float64)
        at = np.arange(p.size)
        before = cumulative[at, block] - block_sums[at, block]
        with np.errstate(invalid="ignore", divide="ignore"):  # a row with no mass
            inner = np.clip((u * cumulative[:, -1] - before) / block_sums[at, block], 0.0, _BELOW_ONE)
        index = block[:, None] * _BLOCK + np.arange(_BLOCK)
        chosen = np.exp((rows[at[:, None], np.minimum(index, vocab - 1)] - shift[:, None]) * inverse[:, None])
        chosen[index >= vocab] = 0.0  # padding tokens carry no mass
        tokens[p] = block * _BLOCK + _first_above(chosen, inner)
    return tokens


def _block_sums(rows: np.ndarray, inverse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mass exp((x - shift) / t) of each row of `rows` summed per block
    of `_BLOCK` tokens (float32, shape (rows, blocks)), and the shifts.

    exp(x / t) needs no shift by the row's maximum where it neither
    overflows nor leaves the likely tokens denormal (the draw only needs
    the mass up to a common factor), so the shift is 0 and the maximum is
    not searched for, a pass saved; a row whose total mass overflowed, or
    came below `_SMALLEST_MASS`, is done again shifted by its maximum. The
    work goes a few rows at a time (`_SCRATCH_BYTES`) through a float32 scratch that stays
    in cache, each row summed on its own (so its sums do not depend on its
    batch mates).
    """
    count, vocab = rows.shape
    blocks = -(-vocab // _BLOCK)
    ones = np.ones(_BLOCK, dtype=np.float32)
    chunk = max(1, min(count, _SCRATCH_BYTES // (4 * blocks * _BLOCK)))
    scratch = np.empty((chunk, blocks * _BLOCK), dtype=np.float32)
    scratch[:, vocab:] = 0.0  # padding tokens carry no mass
    sums = np.empty((count, blocks), dtype=np.float32)
    shift = np.zeros(count, dtype=np.float32)

    def exp_and_sum(start: int, stop: int) -> None:
        e = scratch[: stop - start]
        if shift[start:stop].any():
            np.subtract(rows[start:stop], shift[start:stop, None], out=e[:, :vocab])
            e[:, :vocab] *= inverse[start:stop, None]
        else:
            np.multiply(rows[start:stop], inverse[start:stop, None], out=e[:, :vocab])
        with np.errstate(over="ignore"):  # an overflowed row is done again, shifted
            np.exp(e[:, :vocab], out=e[:, :vocab])
        for r in range(stop - start):
            np.matmul(e[r].reshape(blocks, _BLOCK), ones, out=sums[start + r])

    for start in range(0, count, chunk):
        exp_and_sum(start, min(start + chunk, count))
    totals = sums.sum(axis=1, dtype=np.float64)
    for r in np.flatnonzero(~(totals >= _SMALLEST_MASS) | np.isinf(totals)):
        top = rows[r].max()
        if np.isfinite(top):
            shift[r] = top
            exp_and_sum(r, r + 1)
    return sums, shift


def _first_above(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row of `weights` (non-negative, each row with some mass), the
    first index whose cumulative weight exceeds `uniform` times the row's
    total: weight zero is never chosen (rounding that leaves no index
    above the target takes the last index with weight, and a row with no
    weight at all its first index)."""
    cumulative = np.cumsum(weights, axis=1, dtype=np.float64)
    above = cumulative > (uniform * cumulative[:, -1])[:, None]
    index = above.argmax(axis=1)
    for r in np.flatnonzero(~above[np.arange(len(index)), index]):
        nonzero = np.flatnonzero(weights[r])
        index[r] = nonzero[-1] if nonzero.size else 0
    return index


def _draw_top_p(e: np.ndarray, total: float, top_p: float, uniform: float) -> int:
    """The draw from a row's unnormalized probabilities `e` (float32)
    after top-p: keep the most probable tokens (ties in vocabulary order)
    whose mass first reaches top_p of `total`. Only candidates are sorted:
    the top `count` by partition, grown until they hold enough mass."""
    target = top_p * total
    count = min(e.size, 64)
    while True:
        if count < e.size:
            floor = e[np.argpartition(e, -count)[-count:]].min()
            candidates = np.flatnonzero(e >= floor)
        else:
            candidates = np.arange(e.size)
        weights = e[candidates].astype(np.float64)
        if count >= e.size or weights.sum() >= target:
            break
        count *= 8
    order = np.argsort(-weights, kind="stable")
    keep = int(np.searchsorted(np.cumsum(weights[order]), target)) + 1
    kept = np.sort(candidates[order[:keep]])
    return int(kept[_first_above(e[kept][None, :], np.array([uniform]))[0]])


def _draw_narrow(x: np.ndarray, params: SamplingParams, inverse: np.float32, uniform: float) -> int:
    """The draw for a row with top-k or min-p: only the tokens those keep
    are exponentiated."""
    vocab = x.size
    k = params.top_k
    top = x.max()
    if 0 < k < vocab:
        kth = np.partition(x, -k)[-k]
        candidates = np.flatnonzero(x >= kth)  # ties at the k-th value are kept
    else:
        floor = top + (np.log(params.min_p) - _MIN_P_SLACK) / inverse
        candidates = np.flatnonzero(x >= floor)
    e = np.exp((x[candidates] - top) * inverse)
    if params.min_p > 0:
        # the largest probability is exp(0) = 1 times the normalizer
        keep = e.astype(np.float64) >= params.min_p
        candidates, e = candidates[keep], e[keep]
    if params.top_p < 1.0:
        kept = _draw_top_p(e, float(e.sum(dtype=np.float64)), params.top_p, uniform)
        return int(candidates[kept])
    return int(candidates[_first_above(e[None, :], np.array([uniform]))[0]])


#: rows of logits one pass of `logprobs_of` works on (its float32 scratch)
_LOGPROB_ROWS = 32


def logprobs_of(logits, rows: Sequence[int], tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of `logits` (numpy, or
    an executor's logits object taking `logits[list_of_rows]`, brought to
    the host in one copy) with the `top_n` most likely tokens: the prompt
    logprobs. The log-softmax works `_LOGPROB_ROWS` rows at a time, so its
    temporaries stay small."""
    if not rows:
        return []
    values = np.asarray(logits[list(rows)], dtype=np.float32)
    out: list[TokenLogprob] = []
    for start in range(0, len(rows), _LOGPROB_ROWS):
        part = _log_softmax(values[start:start + _LOGPROB_ROWS])
        for row, token in zip(part, tokens[start:start + _LOGPROB_ROWS]):
            entry = _token_logprob(row, int(token), top_n)
            entry.rank = int(np.count_nonzero(row > row[entry.token_id])) + 1
            out.append(entry)
    return out


def _token_logprob(values: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        best = np.argpartition(-values, top_n - 1)[:top_n]
        best = best[np.argsort(-values[best], kind="stable")]
        top = [(int(t), float(values[t])) for t in best]
    return TokenLogprob(token_id=token, logprob=float(values[token]), top=top)
