"""Choosing the next token from logits: penalties, bias, temperature, top-k/p, min-p."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lockgate.params import SamplingParams


def make_generator(params: SamplingParams, choice_index: int) -> np.random.Generator:
    """The random stream of one generated sequence.

    Seeded per choice so the same seed and request give the same output no
    matter which other requests share the batch.
    """
    if params.seed is None:
        return np.random.default_rng()
    return np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, choice_index])


def process_logits(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> np.ndarray:
    """Apply logit_bias and the repetition penalties to one row (a copy)."""
    row = np.array(logits, dtype=np.float32, copy=True)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        values = row[seen]
        row[seen] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        row[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return row


def sample_token(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> int:
    """Pick the next token for one sequence from its logits row."""
    row = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return int(np.argmax(row))
    row = row.astype(np.float64) / params.temperature
    if 0 < params.top_k < row.shape[0]:
        kth = np.partition(row, -params.top_k)[-params.top_k]
        row[row < kth] = -np.inf
    row -= row.max()
    probs = np.exp(row)
    probs /= probs.sum()
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
        keep = int(np.searchsorted(cumulative, params.top_p * cumulative[-1])) + 1
        probs[order[keep:]] = 0.0
    cumulative = np.cumsum(probs)
    choice = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(choice, probs.shape[0] - 1)
