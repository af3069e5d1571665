"""The host sampler draws from exactly the distribution its parameters
define, and a seeded row draws the same tokens whatever shares its batch.

Each case draws many tokens through `sample_batch` from one logit row
(seeded, so every run draws the same tokens) and compares how often each
token came up with probabilities computed here independently, in float64,
from the definitions: temperature, then top-k, then min-p against the
largest probability, then top-p over what is left (ties in vocabulary
order), renormalized. The comparison is Pearson's chi-square over bins of
at least `MIN_EXPECTED` expected draws; a case fails below a p-value of
`P_FAIL` (one in ten million for a correct sampler). A token of probability
zero must never be drawn at all. The same check rejects the draws against
probabilities that are slightly wrong (a temperature applied twice, a
top-p cut left out), so it can fail.
"""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest

from lockgate.engine.params import SamplingParams
from lockgate.engine.sampling import SamplingRow, make_generator, sample_batch

#: draws per case: rows of one batch times steps
ROWS, STEPS = 250, 80

#: the smallest expected count of a chi-square bin
MIN_EXPECTED = 20

#: the p-value below which a case fails
P_FAIL = 1e-7


def exact_probabilities(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """The distribution a row's parameters define, in float64."""
    y = logits.astype(np.float64) / temperature
    if allowed is not None:
        y = np.where(allowed, y, -np.inf)
    if 0 < top_k < y.size:
        kth = np.sort(y)[::-1][top_k - 1]
        y = np.where(y >= kth, y, -np.inf)
    p = np.exp(y - y.max())
    p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = sorted(range(p.size), key=lambda t: (-p[t], t))
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += p[t]
            if mass >= top_p:
                break
        q = np.zeros_like(p)
        q[kept] = p[kept]
        p = q / q.sum()
    return p


def draw_counts(logits: np.ndarray, seed: int, allowed: np.ndarray | None = None, **fields) -> np.ndarray:
    """How often each token was drawn: `ROWS` seeded choices of one request,
    `STEPS` steps each, all from `logits`."""
    params = SamplingParams(seed=seed, **fields)
    rows = [SamplingRow(params, make_generator(params, choice), allowed=allowed) for choice in range(ROWS)]
    batch = np.repeat(logits[None, :].astype(np.float32), ROWS, axis=0)
    counts = np.zeros(logits.size, dtype=np.int64)
    for _ in range(STEPS):
        tokens, _ = sample_batch(batch, rows)
        np.add.at(counts, tokens, 1)
    return counts


def chi_square_p_value(counts: np.ndarray, probabilities: np.ndarray) -> float:
    """Pearson's chi-square test of `counts` against `probabilities` (tokens
    of probability zero left out), tokens binned in order of probability
    until each bin expects at least `MIN_EXPECTED` draws. The p-value is
    the Wilson-Hilferty approximation of the chi-square tail."""
    draws = counts.sum()
    live = np.flatnonzero(probabilities > 0)
    live = live[np.argsort(-probabilities[live], kind="stable")]
    observed, expected = [], []
    bin_observed, bin_expected = 0, 0.0
    for t in live:
        bin_observed += counts[t]
        bin_expected += probabilities[t] * draws
        if bin_expected >= MIN_EXPECTED:
            observed.append(bin_observed)
            expected.append(bin_expected)
            bin_observed, bin_expected = 0, 0.0
    if bin_expected:  # the remainder joins the last bin
        observed[-1] += bin_observed
        expected[-1] += bin_expected
    observed, expected = np.array(observed, dtype=np.float64), np.array(expected)
    dof = len(observed) - 1
    assert dof >= 1, "a case needs two bins at least"
    statistic = float(((observed - expected) ** 2 / expected).sum())
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def consistent(counts: np.ndarray, probabilities: np.ndarray) -> bool:
    """Whether the draws `counts` fit `probabilities`: no token of
    probability zero drawn, and the chi-square test passed."""
    return counts[probabilities == 0].sum() == 0 and chi_square_p_value(counts, probabilities) > P_FAIL


def _logits(vocab: int, seed: int, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def _peaked(vocab: int, seed: int) -> np.ndarray:
    """A low, flat tail under a few dozen likely tokens spread over the
    whole vocabulary (so over several of the sampler's blocks)."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(vocab) * 0.5 - 4.0).astype(np.float32)
    likely = rng.choice(vocab, size=40, replace=False)
    logits[likely] = rng.uniform(0.0, 3.0, size=40).astype(np.float32)
    return logits


#: (name, logits, sampling fields); vocabularies not a multiple of 256 too
CASES = [
    ("temperature 0.7", _logits(1000, 1), {"temperature": 0.7}),
    ("temperature 1.0, peaked", _peaked(3000, 2), {"temperature": 1.0}),
    ("temperature 1.5", _logits(300, 3), {"temperature": 1.5}),
    ("temperature 0.5, large logits", _logits(1000, 12) + 60.0, {"temperature": 0.5}),
    ("temperature 0.8, negative logits", _logits(1000, 13) - 40.0, {"temperature": 0.8}),
    ("top-k 5", _logits(1000, 4), {"temperature": 1.3, "top_k": 5}),
    ("top-p 0.8", _peaked(1000, 5), {"temperature": 0.9, "top_p": 0.8}),
    ("top-p 0.5, flat", _logits(700, 6, scale=0.5), {"top_p": 0.5}),
    ("min-p 0.1", _peaked(1000, 7), {"temperature": 1.0, "min_p": 0.1}),
    ("min-p 0.05, flat", _logits(500, 8, scale=0.7), {"temperature": 0.8, "min_p": 0.05}),
    ("top-k 50 + top-p 0.9 + min-p 0.02", _logits(1000, 9), {"temperature": 1.2, "top_k": 50, "top_p": 0.9, "min_p": 0.02}),
    ("top-k 20 + min-p 0.3", _logits(400, 10), {"temperature": 0.6, "top_k": 20, "min_p": 0.3}),
]


@pytest.mark.parametrize("name, logits, fields", CASES, ids=[c[0] for c in CASES])
def test_draws_follow_the_exact_distribution(name, logits, fields):
    counts = draw_counts(logits, seed=zlib.crc32(name.encode()), **fields)
    assert counts.sum() == ROWS * STEPS
    assert consistent(counts, exact_probabilities(logits, **fields))


def test_a_grammar_mask_draws_only_allowed_tokens_in_proportion():
    logits = _logits(1000, 11)
    allowed = np.zeros(1000 + 24, dtype=bool)  # longer than the vocabulary, as a matcher's may be
    allowed[np.random.default_rng(12).choice(1000, size=60, replace=False)] = True
    counts = draw_counts(logits, seed=5, allowed=allowed, temperature=0.9)
    probabilities = exact_probabilities(logits, temperature=0.9, allowed=allowed[:1000])
    assert counts[~allowed[:1000]].sum() == 0
    assert consistent(counts, probabilities)


@pytest.mark.parametrize(
    "wrong",
    [
        {"temperature": 0.7 * 0.7},  # the temperature applied twice
        {"temperature": 0.75},
        {"temperature": 0.7, "top_p": 0.9},  # cuts the request did not ask for
        {"temperature": 0.7, "top_k": 100},
        {"temperature": 0.7, "min_p": 0.01},
    ],
)
def test_the_check_rejects_a_slightly_wrong_distribution(wrong):
    """Draws at temperature 0.7 tested against other distributions: the
    check must reject them, or it could not catch a sampler that drew so."""
    logits = _logits(1000, 1)
    counts = draw_counts(logits, seed=3, temperature=0.7)
    assert consistent(counts, exact_probabilities(logits, temperature=0.7))
    assert not consistent(counts, exact_probabilities(logits, **wrong))


# seeds ---------------------------------------------------------------------

#: the kinds of rows a seeded row may share a batch with
MATES = [
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.9},
    {"min_p": 0.1},
    {"temperature": 0.8, "presence_penalty": 0.5, "logit_bias": {3: 4.0}},
    {"temperature": 0.5, "logprobs": 2},
]


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 0.7}, {"temperature": 1.1, "top_p": 0.8}, {"top_k": 40}, {"min_p": 0.05, "temperature": 0.9}],
)
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_seeded_rows_do_not_depend_on_batch_mates(fields, vocab):
    """A seeded request's tokens, step after step, are the same alone and in
    batches of other requests (greedy, sampled, filtered, penalized,
    masked) at any position, also past the sampler's chunks of rows."""
    rng = np.random.default_rng(vocab)
    steps = 6
    logits = [(rng.standard_normal((40, vocab)) * 3).astype(np.float32) for _ in range(steps)]
    mask = np.ones(vocab, dtype=bool)
    mask[::3] = False
    params = SamplingParams(seed=1234, **fields)

    def generate(position: int, batch: int) -> list[int]:
        own = SamplingRow(params, make_generator(params, 0))
        mates = []
        for j in range(batch - 1):
            p = SamplingParams(seed=j, **MATES[j % len(MATES)])
            mates.append(SamplingRow(p, make_generator(p, 0), (1, 2), (3,), mask if j % 4 == 1 else None))
        rows = mates[:position] + [own] + mates[position:]
        out = []
        for step in range(steps):
            step_logits = logits[step][:batch].copy()
            step_logits[position] = logits[step][39]  # the seeded row's logits, wherever it sits
            if batch > 1:  # a mate beside it whose logits are far above the others
                step_logits[position + 1 if position == 0 else position - 1] += 100.0
            tokens, _ = sample_batch(step_logits, rows)
            out.append(int(tokens[position]))
        return out

    alone = generate(0, 1)
    assert generate(0, 40) == alone
    assert generate(17, 40) == alone
    assert generate(39, 40) == alone
    assert generate(3, 5) == alone


# rows without a usable distribution ---------------------------------------


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_rows_with_no_finite_mass_still_get_a_token_in_the_vocabulary(top_p):
    """A row whose every logit is -inf or nan, or so large that exp
    overflows, beside an ordinary row: each gets a token id inside the
    vocabulary (the large row its likeliest token, as the shift by its
    maximum leaves it), the ordinary row its usual draw, and numpy warns
    of nothing."""
    vocab = 1000
    ordinary = _logits(vocab, 14)
    logits = np.stack([
        np.full(vocab, -np.inf, dtype=np.float32),
        np.full(vocab, np.nan, dtype=np.float32),
        _logits(vocab, 15) * 50.0 + 200.0,
        ordinary,
    ]).astype(np.float32)
    params = SamplingParams(seed=9, temperature=0.01, top_p=top_p)

    def rows():
        return [SamplingRow(params, make_generator(params, 0)) for _ in range(4)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, _ = sample_batch(logits, rows())
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert tokens[2] == int(np.argmax(logits[2]))
    alone, _ = sample_batch(logits[3:], rows()[:1])
    assert tokens[3] == alone[0]
