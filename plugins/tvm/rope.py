"""RoPE with per-frequency divisors, for the KV cache's Q/K rotation.

Llama 3.1 and later ship their RoPE scaling as `rope_freqs.weight`: one
divisor per rotated frequency, so frequency i is θ^(-2i/d) / factor[i]
(llama.cpp's `freq_factors`). TVM's KV cache takes such factors as its
`rope_ext_factors` buffer and hands them to its rotation kernel as the
sixth argument, but TVM 0.27's only kernel that reads them (LongRoPE's)
fails to parse (it tests a buffer for truth). `rope_kernel` has
the cache build this kernel instead, which rotates halves (the layout the
weight loader produces) with the factors the buffer holds.

On the CPU, whose KV cache is lockgate's own (`paged_attention`),
`split_rotate_cpu` splits and rotates: TVM's kernel computes θ^(2i/d) and
the angle's cosine and sine for every element of every head (a quarter of
a default-model prefill went to `powf` and `sincosf`); this one computes
each token's angles once, with the same expressions (so the same values),
and rotates all its Q and K heads with them, vectorized over the frequencies.
"""

from __future__ import annotations

import contextlib

from tvm import tirx
from tvm.script import tirx as T


def rope_with_frequency_factors(
    theta: float,
    scale: float,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: str,
    rope_scaling: dict,
    rotary_dim: int | None = None,
):
    """The cache's `tir_split_rotary` kernel, with the signature of
    `llama_rope_with_position_map`: split fused Q/K/V into q, k, v and
    rotate the first `rotary_dim` features of q and k by their positions.

    `factors` holds `rotary_dim` values, the divisors of the `rotary_dim / 2`
    frequencies twice over (TVM's layout for long and short factors).
    """
    del rope_scaling  # the factors arrive at run time
    rotary_dim = rotary_dim or head_dim
    half = rotary_dim // 2
    fused_heads = num_q_heads + 2 * num_kv_heads

    def rotated(qkv, s, h, d, position, factors):
        i = d % half
        exponent = (2 * i).astype("float32") / tirx.const(rotary_dim, "float32")
        angle = (position.astype("float32") * tirx.const(scale, "float32")) / (
            factors[i] * tirx.power(tirx.const(theta, "float32"), exponent)
        )
        partner = tirx.if_then_else(d < half, -qkv[s, h, d + half], qkv[s, h, d - half])
        value = tirx.cos(angle) * qkv[s, h, d].astype("float32") + tirx.sin(angle) * partner.astype("float32")
        return value.astype(dtype)

    @T.prim_func(s_tir=True)
    def fused_rope_with_factors(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        factors: T.Buffer((rotary_dim,), "float32"),  # type: ignore  # noqa: F821
    ):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, fused_heads, head_dim), dtype)
        q = T.match_buffer(var_q, (seq_len, num_q_heads, head_dim), dtype)
        k = T.match_buffer(var_k, (seq_len, num_kv_heads, head_dim), dtype)
        v = T.match_buffer(var_v, (seq_len, num_kv_heads, head_dim), dtype)
        position_map = T.match_buffer(
            var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset
        )
        for iters in T.grid(seq_len, fused_heads, head_dim):
            with T.sblock("llama_fused_rope"):
                s, h, d = T.axis.remap("SSS", iters)
                if h < num_q_heads:
                    q[s, h, d] = T.if_then_else(
                        d < rotary_dim, rotated(qkv, s, h, d, position_map[s], factors), qkv[s, h, d]
                    )
                elif h < num_q_heads + num_kv_heads:
                    k[s, h - num_q_heads, d] = T.if_then_else(
                        d < rotary_dim, rotated(qkv, s, h, d, position_map[s], factors), qkv[s, h, d]
                    )
                else:
                    v[s, h - (num_q_heads + num_kv_heads), d] = qkv[s, h, d]

    return fused_rope_with_factors


def split_rotate_cpu(
    theta: float,
    scale: float,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: str,
    rotary_dim: int | None = None,
    *,
    rotate: bool = True,
    factors: bool = False,
):
    """The CPU's split of fused Q/K/V into q, k and v with Q and K rotated
    by halves (`rotate`; else only split), as `(qkv, positions[, factors],
    q, k, v)`: the KV cache of `paged_attention` calls it through
    `call_tir`. Tokens in parallel, each token's cosines and sines computed
    once for all its heads, with the expressions of TVM's
    `llama_rope_with_position_map` (so its values); with `factors`, the
    `rotary_dim` divisors of Llama 3.1's frequencies (the half-size list
    twice over)."""
    rotary_dim = rotary_dim or head_dim
    half = rotary_dim // 2
    fused_heads = num_q_heads + 2 * num_kv_heads

    def angle(position, i, factor_buffer):
        position = position.astype("float32") * tirx.const(scale, "float32")
        exponent = (2 * i).astype("float32") / tirx.const(rotary_dim, "float32")
        if factor_buffer is None:  # TVM's `rope_freq_default`, term for term
            return position / tirx.power(tirx.const(theta, "float32"), exponent)
        return position / (factor_buffer[i] * tirx.power(tirx.const(theta, "float32"), exponent))

    def first(qkv, trig, s, h, i):  # feature i of a head rotated, i < half
        return trig[0, i] * qkv[s, h, i].astype("float32") + trig[1, i] * (-qkv[s, h, i + half]).astype("float32")

    def second(qkv, trig, s, h, i):  # feature i + half
        return trig[0, i] * qkv[s, h, i + half].astype("float32") + trig[1, i] * qkv[s, h, i].astype("float32")

    rotated = rotary_dim if rotate else 0

    @T.macro
    def split_token(qkv, q, k, v, s, position, factor_buffer):
        trig = T.sblock_alloc_buffer((2, half), "float32", scope="local")
        for i in T.serial(half):
            trig[0, i] = T.cos(angle(position, i, factor_buffer))
            trig[1, i] = T.sin(angle(position, i, factor_buffer))
        for h in T.serial(num_q_heads + num_kv_heads):
            if rotate:
                for i in T.vectorized(half):
                    # (no let-bound temporaries: TVM 0.27's vectorizer gives every lane the last one's)
                    if h < num_q_heads:
                        q[s, h, i] = T.Cast(dtype, first(qkv, trig, s, h, i))
                        q[s, h, i + half] = T.Cast(dtype, second(qkv, trig, s, h, i))
                    else:
                        k[s, h - num_q_heads, i] = T.Cast(dtype, first(qkv, trig, s, h, i))
                        k[s, h - num_q_heads, i + half] = T.Cast(dtype, second(qkv, trig, s, h, i))
            # what is not rotated is copied: the features past `rotary_dim`, or all without rotation
            for d in T.serial(rotated, head_dim):
                if h < num_q_heads:
                    q[s, h, d] = qkv[s, h, d]
                else:
                    k[s, h - num_q_heads, d] = qkv[s, h, d]
        for h in T.serial(num_kv_heads):
            for d in T.vectorized(head_dim):
                v[s, h, d] = qkv[s, num_q_heads + num_kv_heads + h, d]

    def buffers(var_qkv, var_positions, var_q, var_k, var_v, seq_len):
        return (
            T.match_buffer(var_qkv, (seq_len, fused_heads, head_dim), dtype),
            T.match_buffer(var_positions, (seq_len,), "int32"),
            T.match_buffer(var_q, (seq_len, num_q_heads, head_dim), dtype),
            T.match_buffer(var_k, (seq_len, num_kv_heads, head_dim), dtype),
            T.match_buffer(var_v, (seq_len, num_kv_heads, head_dim), dtype),
        )

    @T.prim_func(s_tir=True)
    def split_rotate(var_qkv: T.handle, var_positions: T.handle, var_q: T.handle, var_k: T.handle,
                     var_v: T.handle):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        qkv, positions, q, k, v = buffers(var_qkv, var_positions, var_q, var_k, var_v, seq_len)
        for s in T.parallel(seq_len):
            with T.sblock("split_rotate"):
                T.reads(qkv[s, :, :], positions[s])
                T.writes(q[s, :, :], k[s, :, :], v[s, :, :])
                split_token(qkv, q, k, v, s, positions[s], None)

    @T.prim_func(s_tir=True)
    def split_rotate_with_factors(
        var_qkv: T.handle, var_positions: T.handle,
        factor_buffer: T.Buffer((rotary_dim,), "float32"),  # type: ignore  # noqa: F821
        var_q: T.handle, var_k: T.handle, var_v: T.handle,
    ):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        qkv, positions, q, k, v = buffers(var_qkv, var_positions, var_q, var_k, var_v, seq_len)
        for s in T.parallel(seq_len):
            with T.sblock("split_rotate"):
                T.reads(qkv[s, :, :], positions[s], factor_buffer[:])
                T.writes(q[s, :, :], k[s, :, :], v[s, :, :])
                split_token(qkv, q, k, v, s, positions[s], factor_buffer)

    return split_rotate_with_factors if factors else split_rotate


@contextlib.contextmanager
def rope_kernel(factors: bool):
    """Have a `TIRPagedKVCache` (CUDA's) built in the block rotate with
    `rope_with_frequency_factors` for a model with frequency factors, else
    with TVM's own (the cache looks the factory up as a module global when
    it is constructed)."""
    from tvm.relax.frontend.nn.llm import kv_cache

    original = kv_cache.llama_rope_with_position_map
    if factors:
        kv_cache.llama_rope_with_position_map = rope_with_frequency_factors
    try:
        yield
    finally:
        kv_cache.llama_rope_with_position_map = original


def rotate_halves_te(qkv, positions, q_heads: int, kv_heads: int, rotary_dim: int, theta: float, scale: float):
    """RoPE in the model rather than in the KV cache (for models whose
    layers rotate with different bases, which one cache setting cannot
    hold): fused (b, s, heads, d) Q/K/V with Q and K rotated by halves at
    the tokens' `positions` ((b * s,) int32, the cache's query positions),
    V passed through.
    """
    from tvm import te

    b, s, heads, d = qkv.shape
    half = rotary_dim // 2

    def body(i, j, h, f):
        x = qkv[i, j, h, f].astype("float32")
        k = f % half
        exponent = (2 * k).astype("float32") / tirx.const(rotary_dim, "float32")
        position = positions[i * s + j].astype("float32") * tirx.const(scale, "float32")
        angle = position / tirx.power(tirx.const(theta, "float32"), exponent)
        partner = tirx.if_then_else(f < half, -qkv[i, j, h, f + half], qkv[i, j, h, f - half]).astype("float32")
        rotated = tirx.cos(angle) * x + tirx.sin(angle) * partner
        keep = tirx.any(h >= q_heads + kv_heads, f >= rotary_dim)
        return tirx.Select(keep, x, rotated).astype(qkv.dtype)

    return te.compute(qkv.shape, body, name="rope")
