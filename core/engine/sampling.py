"""Choosing next tokens for a batch: bias, penalties, grammar masks,
temperature, top-k/top-p/min-p, seeded draws, and logprobs.

The work is vectorized over the batch; per-row loops remain only for the
sparse adjustments (bias, penalties) and for top-k/top-p, which only the rows
that ask for them pay.
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
    x = np.array(logits[:batch], dtype=np.float32, copy=True)
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
        tokens[sampled] = _draw(x[sampled], [rows[i] for i in sampled])
    logprobs: list[TokenLogprob | None] = [None] * batch
    for i, values in raw_logprobs.items():
        logprobs[i] = _token_logprob(values, int(tokens[i]), rows[i].params.logprobs)
    return tokens, logprobs


def _draw(x: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    temperatures = np.fromiter((r.params.temperature for r in rows), dtype=np.float32, count=len(rows))
    x /= temperatures[:, None]
    for i, row in enumerate(rows):
        k = row.params.top_k
        if 0 < k < x.shape[1]:
            kth = np.partition(x[i], -k)[-k]
            x[i, x[i] < kth] = -np.inf
    x -= x.max(axis=1, keepdims=True)
    probs = np.exp(x, dtype=np.float64)
    probs /= probs.sum(axis=1, keepdims=True)
    min_p = np.fromiter((r.params.min_p for r in rows), dtype=np.float64, count=len(rows))
    if min_p.any():
        probs[probs < (min_p * probs.max(axis=1))[:, None]] = 0.0
    for i, row in enumerate(rows):
        top_p = row.params.top_p
        if top_p < 1.0:
            order = np.argsort(-probs[i], kind="stable")
            cumulative = np.cumsum(probs[i, order])
            # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
            keep = int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1
            probs[i, order[keep:]] = 0.0
    cumulative = np.cumsum(probs, axis=1)
    draws = np.fromiter((r.rng.random() for r in rows), dtype=np.float64, count=len(rows))
    # the first index whose cumulative mass exceeds the draw: zero-probability
    # tokens add no mass, so they are never chosen
    return np.argmax(cumulative > (draws * cumulative[:, -1])[:, None], axis=1)


def _token_logprob(values: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        best = np.argpartition(-values, top_n - 1)[:top_n]
        best = best[np.argsort(-values[best], kind="stable")]
        top = [(int(t), float(values[t])) for t in best]
    return TokenLogprob(token_id=token, logprob=float(values[token]), top=top)
