"""The CPU's split and rotation of fused Q/K/V (`rope.split_rotate_cpu`)
against TVM's own kernels, value for value (the attention kernels are
`test_paged_attention`'s; the model-level checks, `test_tvm_executor` and
the goldens, run them inside whole models)."""

from __future__ import annotations

import math

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from lockgate.plugins.tvm.rope import rope_with_frequency_factors, split_rotate_cpu  # noqa: E402

TARGET = tvm.target.Target.from_device(tvm.cpu())


def _tensor(array):
    return tvm.runtime.tensor(np.ascontiguousarray(array), tvm.cpu())


def _compile(func, name):
    return tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=TARGET)


def _rotate(func, name, qkv, positions, last, q_heads, kv_heads, ours=False):
    """q, k, v from a split-and-rotate kernel: TVM's cache's signature
    `(qkv, positions, q, k, v, last)`, or ours, `(qkv, positions[, last], q, k, v)`."""
    lib = _compile(func, name)
    n, _, d = qkv.shape
    outs = [_tensor(np.zeros((n, h, d), qkv.dtype)) for h in (q_heads, kv_heads, kv_heads)]
    if not ours:
        lib[name](_tensor(qkv), _tensor(positions), *outs, last)
    elif last is None:
        lib[name](_tensor(qkv), _tensor(positions), *outs)
    else:
        lib[name](_tensor(qkv), _tensor(positions), last, *outs)
    return [out.numpy() for out in outs]


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, None), (64, None), (64, 32)])
def test_split_rotate_cpu_gives_tvms_values(head_dim, rotary_dim):
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    q_heads, kv_heads = 6, 2
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((9, q_heads + 2 * kv_heads, head_dim)).astype(np.float16)
    positions = np.array([0, 1, 2, 7, 100, 1000, 4095, 3, 5], np.int32)
    args = (500000.0, 1.0, head_dim, q_heads, kv_heads, "float16")
    for apply_rope in (1, 0):
        ours = _rotate(split_rotate_cpu(*args, rotary_dim, rotate=bool(apply_rope)), "ours", qkv, positions, None,
                       q_heads, kv_heads, ours=True)
        tvms = _rotate(llama_rope_with_position_map(*args, {}, rotary_dim), "tvms", qkv, positions, apply_rope,
                       q_heads, kv_heads)
        for a, b in zip(ours, tvms):
            np.testing.assert_array_equal(a, b)
    # and the rotation is a rotation: position 0 leaves q as it was
    np.testing.assert_array_equal(ours[0][0], qkv[0, :q_heads])


def test_split_rotate_cpu_with_frequency_factors_gives_the_factor_kernels_values():
    head_dim, q_heads, kv_heads = 32, 4, 2
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((5, q_heads + 2 * kv_heads, head_dim)).astype(np.float16)
    positions = np.array([0, 3, 50, 900, 8000], np.int32)
    factors = np.tile(rng.uniform(1.0, 8.0, head_dim // 2), 2).astype(np.float32)
    scaling = {"rope_type": "longrope", "max_position_embeddings": 8192, "original_max_position_embeddings": 8192}
    args = (500000.0, 1.0, head_dim, q_heads, kv_heads, "float16")
    ours = _rotate(split_rotate_cpu(*args, factors=True), "ours", qkv, positions, _tensor(factors), q_heads,
                   kv_heads, ours=True)
    theirs = _rotate(rope_with_frequency_factors(*args, scaling), "theirs", qkv, positions, _tensor(factors),
                     q_heads, kv_heads)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
