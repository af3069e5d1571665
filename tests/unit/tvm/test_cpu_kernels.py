"""The CPU kernels lockgate has the KV cache build in place of TVM's:
RoPE (`rope.rope_cpu`) against TVM's own kernels, value for value, and the
tiled prefill attention (`kernels.py`, ragged and paged, causal and
sliding-window) against float64 softmax attention, and their vectorized
exp2 (`kernels.exp2_approx`, which SiLU uses too); the model-level checks
(`test_tvm_executor`, the goldens) run them inside whole models."""

from __future__ import annotations

import math

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from lockgate.plugins.tvm import kernels  # noqa: E402
from lockgate.plugins.tvm.rope import rope_cpu, rope_with_frequency_factors  # noqa: E402

TARGET = tvm.target.Target.from_device(tvm.cpu())


def _tensor(array):
    return tvm.runtime.tensor(np.ascontiguousarray(array), tvm.cpu())


def _compile(func, name):
    return tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=TARGET)


def _rotate(func, name, qkv, positions, last, q_heads, kv_heads):
    lib = _compile(func, name)
    n, _, d = qkv.shape
    outs = [_tensor(np.zeros((n, h, d), qkv.dtype)) for h in (q_heads, kv_heads, kv_heads)]
    lib[name](_tensor(qkv), _tensor(positions), *outs, last)
    return [out.numpy() for out in outs]


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, None), (64, None), (64, 32)])
def test_rope_cpu_gives_tvms_values(head_dim, rotary_dim):
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    q_heads, kv_heads = 6, 2
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((9, q_heads + 2 * kv_heads, head_dim)).astype(np.float16)
    positions = np.array([0, 1, 2, 7, 100, 1000, 4095, 3, 5], np.int32)
    args = (500000.0, 1.0, head_dim, q_heads, kv_heads, "float16", {}, rotary_dim)
    for apply_rope in (1, 0):
        ours = _rotate(rope_cpu(*args), "ours", qkv, positions, apply_rope, q_heads, kv_heads)
        tvms = _rotate(llama_rope_with_position_map(*args), "tvms", qkv, positions, apply_rope, q_heads, kv_heads)
        for a, b in zip(ours, tvms):
            np.testing.assert_array_equal(a, b)
    # and the rotation is a rotation: position 0 leaves q as it was
    np.testing.assert_array_equal(ours[0][0], qkv[0, :q_heads])


def test_rope_cpu_with_frequency_factors_gives_the_factor_kernels_values():
    head_dim, q_heads, kv_heads = 32, 4, 2
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((5, q_heads + 2 * kv_heads, head_dim)).astype(np.float16)
    positions = np.array([0, 3, 50, 900, 8000], np.int32)
    factors = np.tile(rng.uniform(1.0, 8.0, head_dim // 2), 2).astype(np.float32)
    scaling = {"rope_type": "longrope", "max_position_embeddings": 8192, "original_max_position_embeddings": 8192}
    args = (500000.0, 1.0, head_dim, q_heads, kv_heads, "float16", scaling)
    ours = _rotate(rope_cpu(*args), "ours", qkv, positions, _tensor(factors), q_heads, kv_heads)
    theirs = _rotate(rope_with_frequency_factors(*args), "theirs", qkv, positions, _tensor(factors), q_heads, kv_heads)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


def _reference(q, keys, values, visible, scale):
    """float64 softmax attention of each query row over keys first..end of
    its sequence (`visible[row]`), and the log-sum-exp in base 2."""
    rows, heads, d = q.shape
    group = heads // keys[0].shape[1]
    out = np.zeros((rows, heads, d))
    lse = np.full((rows, heads), kernels._NO_SCORE)
    for row in range(rows):
        seq, first, end = visible[row]
        if end <= first:
            continue
        for h in range(heads):
            k = keys[seq][first:end, h // group].astype(np.float64)
            v = values[seq][first:end, h // group].astype(np.float64)
            scores = k @ q[row, h].astype(np.float64) * scale
            top = scores.max()
            weights = np.exp(scores - top)
            out[row, h] = weights @ v / weights.sum()
            lse[row, h] = (top + np.log(weights.sum())) / math.log(2)
    return out, lse


@pytest.mark.parametrize("causal", [1, 0])
def test_ragged_prefill_attention_against_float64(causal):
    """Sequences of lengths that fill a query tile and a key block, miss
    them by one, or are a single token; grouped-query heads."""
    h_kv, h_q, d = 2, 6, 32
    lengths = [1, 5, 16, 17, 40]
    rng = np.random.default_rng(2)
    n = sum(lengths)
    q = rng.standard_normal((n, h_q, d)).astype(np.float16)
    k = rng.standard_normal((n, h_kv, d)).astype(np.float16)
    v = rng.standard_normal((n, h_kv, d)).astype(np.float16)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lib = _compile(kernels.attention_prefill_ragged_cpu(h_kv, h_q, d, d, "float16", None), "batch_prefill_ragged_kv")
    out, lse = _tensor(np.zeros((n, h_q, d), np.float16)), _tensor(np.zeros((n, h_q), np.float32))
    scale = 1 / math.sqrt(d)
    lib["batch_prefill_ragged_kv"](
        _tensor(q), _tensor(indptr), _tensor(k), _tensor(v), _tensor(indptr), _tensor(np.zeros(n, np.int32)),
        _tensor(np.zeros(len(lengths), np.int32)), out, lse, causal, 0, 1.0, 1e4, scale,
    )
    keys = [k[a:b] for a, b in zip(indptr, indptr[1:])]
    values = [v[a:b] for a, b in zip(indptr, indptr[1:])]
    visible = [
        (seq, 0, row + 1 if causal else length)
        for seq, length in enumerate(lengths) for row in range(length)
    ]
    want_out, want_lse = _reference(q, keys, values, visible, scale)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-3)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 20])
def test_paged_prefill_attention_against_float64(window):
    """A chunk's queries over what the cache holds for its sequence, in
    pages listed out of order, the last one part full: every cached key, as
    the cache asks it (not causal: they all precede the chunk); with a
    sliding window (causal), query `row` sees the last `window - row - 1`."""
    h_kv, h_q, d, page = 2, 4, 16, kernels.PAGE_SIZE
    cached = [37, 3, 16]
    chunks = [6, 9, 2]
    rng = np.random.default_rng(3)
    num_pages = [-(-c // page) for c in cached]
    order = rng.permutation(sum(num_pages) + 2).astype(np.int32)  # two pages nobody lists
    pages = rng.standard_normal((len(order), 2, h_kv, page, d)).astype(np.float16)
    pages[order[-2:]] = np.nan  # never read
    page_indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    page_values = order[: sum(num_pages)]
    last_len = np.array([c - (n - 1) * page for c, n in zip(cached, num_pages)], np.int32)
    n = sum(chunks)
    q = rng.standard_normal((n, h_q, d)).astype(np.float16)
    q_indptr = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    sliding = window > 0
    func = kernels.attention_prefill_paged_cpu(
        h_kv, h_q, d, "float16", sliding, None, sliding_window_size=window or 1024
    )
    lib = _compile(func, "main")
    length_info = np.stack([last_len, np.zeros_like(last_len), np.zeros_like(last_len)]) if sliding else last_len
    out, lse = _tensor(np.zeros((n, h_q, d), np.float16)), _tensor(np.zeros((n, h_q), np.float32))
    scale = 1 / math.sqrt(d)
    lib["main"](
        _tensor(q), _tensor(q_indptr), _tensor(pages), _tensor(page_indptr), _tensor(page_values),
        _tensor(length_info), _tensor(np.zeros(len(cached), np.int32)), _tensor(np.zeros(n, np.int32)),
        out, lse, int(sliding), 0, 1.0, 1e4, scale,
    )
    keys, values = [], []
    for seq in range(len(cached)):
        listed = page_values[page_indptr[seq]:page_indptr[seq + 1]]
        keys.append(np.concatenate([pages[p, 0].transpose(1, 0, 2) for p in listed])[: cached[seq]])
        values.append(np.concatenate([pages[p, 1].transpose(1, 0, 2) for p in listed])[: cached[seq]])
    visible = [
        (seq, max(cached[seq] - max(window - row - 1, 0), 0) if sliding else 0, cached[seq])
        for seq in range(len(cached)) for row in range(chunks[seq])
    ]
    want_out, want_lse = _reference(q, keys, values, visible, scale)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-3)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-4, rtol=1e-5)


def test_exp2_approx_is_float32_accurate():
    """The vectorized 2**x of the attention kernels and the CPU's SiLU:
    within 2.5e-7 of float64's, exactly 0 below -126, 2**126 above it."""
    from tvm import te

    x = np.concatenate([np.linspace(-130, 130, 100_001), [-126.5, -1e9, 0.0, 1e-30, 200.0]]).astype(np.float32)
    inp = te.placeholder((len(x),), "float32", name="x")
    out = te.compute(inp.shape, lambda i: kernels.exp2_approx(inp[i]), name="y")
    func = te.create_prim_func([inp, out])
    got = _tensor(np.zeros_like(x))
    _compile(func, "exp2")["exp2"](_tensor(x), got)
    got = got.numpy().astype(np.float64)
    want = np.exp2(np.clip(x.astype(np.float64), None, 126.0))
    inside = (x > -126) & (x <= 126)
    np.testing.assert_allclose(got[inside], want[inside], rtol=2.5e-7)
    assert (got[x <= -126] == 0).all()
    assert (got[x > 126] == 2.0**126).all()
