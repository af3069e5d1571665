"""The TVM executor's final hidden states (`prefill_hidden`), what
embeddings pool and a classification head scores, against the numpy
forward of the same file."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from reference_model import reference_logits  # noqa: E402
from tiny_executor import PROMPT, make_executor  # noqa: E402
from tiny_model import write_tiny_gguf  # noqa: E402

#: family overrides of the tiny writer, one file each
FAMILIES = {
    "llama": {},
    "qwen2": {"architecture": "qwen2", "attention_bias": True},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0},
    "gemma3": {
        "architecture": "gemma3", "qk_norm": True, "head_dim": 32, "num_layers": 4, "sliding_window": 8,
        "sliding_window_pattern": 2, "rope_local_theta": 10000.0, "rope_theta": 1000000.0,
        "final_logit_softcap": 30.0, "context_length": 512,
    },
}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tvm-cache")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("hidden")
    return {name: write_tiny_gguf(d / f"{name}.gguf", **overrides) for name, overrides in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_match_numpy_reference(family, files, compile_cache):
    path = files[family]
    ex = make_executor(path, compile_cache, exact_matmul=True)
    try:
        want = reference_logits(path, PROMPT, hidden=True)
        ex.add_sequence(0)
        got = ex.prefill_hidden([0], [PROMPT], [True])
        assert ex.can_embed
        assert got.shape == (len(PROMPT), ex.config.hidden_size)
        assert got.dtype == np.float32
        # the float16 KV cache again, as for the logits (test_tvm_executor)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
        ex.add_sequence(1)
        last = ex.prefill_hidden([1], [PROMPT])
        assert last.shape == (1, ex.config.hidden_size)
        np.testing.assert_allclose(last[0], got[-1], atol=1e-5, rtol=1e-5)
    finally:
        ex.close()


def test_hidden_rows_follow_chunks_and_fill_the_cache(files, compile_cache):
    """Rows in the chunks' order (every row for a chunk that asks, else its
    last), a prompt split across calls equal to one call, and the KV it
    leaves the same as `prefill`'s: decoding on from it gives the same
    logits."""
    ex = make_executor(files["llama"], compile_cache, exact_matmul=True)
    try:
        other = [1, 80, 81, 82, 83]
        for seq_id in (0, 1, 2, 3):
            ex.add_sequence(seq_id)
        rows = ex.prefill_hidden([0, 1], [PROMPT, other], [False, True])
        assert rows.shape == (1 + len(other), ex.config.hidden_size)
        np.testing.assert_allclose(rows[1:], reference_logits(files["llama"], other, hidden=True),
                                   atol=2e-3, rtol=1e-3)
        ex.prefill_hidden([2], [PROMPT[:5]])
        split = ex.prefill_hidden([2], [PROMPT[5:]])
        np.testing.assert_allclose(split[0], rows[0], atol=1e-5, rtol=1e-5)
        ex.prefill([3], [PROMPT])
        np.testing.assert_allclose(ex.decode([0], [40])[0], ex.decode([3], [40])[0], atol=1e-5, rtol=1e-5)
    finally:
        ex.close()


def test_hidden_states_refuse_what_prefill_refuses(files, compile_cache):
    ex = make_executor(files["llama"], compile_cache)
    try:
        ex.add_sequence(0)
        with pytest.raises(ValueError, match="unknown sequence id"):
            ex.prefill_hidden([5], [PROMPT])
        with pytest.raises(ValueError, match="at least one token"):
            ex.prefill_hidden([0], [[]])
        with pytest.raises(ValueError, match="out of range"):
            ex.prefill_hidden([0], [[ex.vocab_size]])
        assert ex.free_pages() == ex.total_pages
    finally:
        ex.close()
