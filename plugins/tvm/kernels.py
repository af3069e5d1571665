"""A parallel CPU kernel for the KV cache's ragged prefill attention.

TVM 0.27's `_attention_prefill_ragged_cpu` runs every sequence, query and
head serially with scalar loops and scores all n² (query, key) pairs. The
replacement keeps its signature and output contract (attention output plus
the log-sum-exp in the log2 domain, so the cache's merge kernels still
combine it with attention over earlier pages) and:

* runs (head, query) pairs in parallel, heads outermost so each thread gets
  whole heads and the causal triangle's work splits evenly;
* visits only the keys the causal mask lets a query see;
* keeps an online softmax over blocks of keys, so no score matrix is stored;
* vectorizes the q·k dot products and the weighted sum of values over the
  head dimension.

Queries and keys arrive with RoPE already applied (the model uses
`RopeMode.NORMAL`), so the kernel ignores its rotary arguments.
"""

from __future__ import annotations

import contextlib
import math

from tvm.script import tirx as T

_LOG2E = math.log2(math.exp(1))
_KEY_BLOCK = 16
_LANES = 8


def attention_prefill_ragged_cpu(h_kv, h_q, d_qk, d_v, dtype, rope_scaling):
    """Drop-in for `kv_cache._attention_prefill_ragged_cpu` (same arguments)."""
    group_size = h_q // h_kv
    assert d_qk % _LANES == 0, "head dimension must be a multiple of 8"
    chunks = d_qk // _LANES
    blk = _KEY_BLOCK

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()

        q = T.match_buffer(var_q, (qo_len, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        for b in T.serial(batch_size):
            for work in T.parallel(h_q * (q_indptr[b + 1] - q_indptr[b])):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], k[:, :, :], v[:, :, :], q_indptr[:], kv_indptr[:])
                    T.writes(output[:, :, :], lse[:, :])
                    scores = T.sblock_alloc_buffer((blk,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((d_v,), "float32", scope="local")
                    partial = T.sblock_alloc_buffer((_LANES,), "float32", scope="local")
                    state = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    q_len_b: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    kv_len_b: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                    h: T.let[T.int32] = work // q_len_b
                    row: T.let[T.int32] = work % q_len_b
                    h_kv_idx: T.let[T.int32] = h // group_size
                    q_row: T.let[T.int32] = q_indptr[b] + row
                    visible: T.let[T.int32] = T.if_then_else(
                        causal > 0, T.min(kv_len_b - q_len_b + row + 1, kv_len_b), kv_len_b
                    )
                    scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
                    # state: running max, running denominator, block max
                    state[0] = T.float32(-5e4)
                    state[1] = T.float32(0)
                    for i in T.vectorized(d_v):
                        acc[i] = T.float32(0)
                    for kb in T.serial((visible + blk - 1) // blk):
                        state[2] = state[0]
                        for j in T.serial(blk):
                            if kb * blk + j < visible:
                                for lane in T.vectorized(_LANES):
                                    partial[lane] = T.float32(0)
                                for c in T.serial(chunks):
                                    for lane in T.vectorized(_LANES):
                                        partial[lane] = partial[lane] + T.Cast(
                                            "float32", q[q_row, h, c * _LANES + lane]
                                        ) * T.Cast(
                                            "float32",
                                            k[kv_indptr[b] + kb * blk + j, h_kv_idx, c * _LANES + lane],
                                        )
                                scores[j] = (
                                    (partial[0] + partial[1]) + (partial[2] + partial[3])
                                    + ((partial[4] + partial[5]) + (partial[6] + partial[7]))
                                ) * scale
                                state[2] = T.max(state[2], scores[j])
                        # Rescale what was summed under the old maximum once per block.
                        for i in T.vectorized(d_v):
                            acc[i] = acc[i] * T.exp2(state[0] - state[2])
                        state[1] = state[1] * T.exp2(state[0] - state[2])
                        state[0] = state[2]
                        for j in T.serial(blk):
                            if kb * blk + j < visible:
                                scores[j] = T.exp2(scores[j] - state[0])
                                state[1] = state[1] + scores[j]
                                for i in T.vectorized(d_v):
                                    acc[i] = acc[i] + scores[j] * T.Cast(
                                        "float32", v[kv_indptr[b] + kb * blk + j, h_kv_idx, i]
                                    )
                    for i in T.vectorized(d_v):
                        output[q_row, h, i] = T.Cast(dtype, acc[i] / state[1])
                    lse[q_row, h] = state[0] + T.log2(state[1])

    return batch_prefill_ragged_kv


@contextlib.contextmanager
def cpu_attention_kernels():
    """Have `TIRPagedKVCache` build the parallel kernel while in the block.

    The cache looks its kernel factories up as module globals when it is
    constructed, so the swap is confined to the export that happens here.
    """
    from tvm.relax.frontend.nn.llm import kv_cache

    original = kv_cache._attention_prefill_ragged_cpu
    kv_cache._attention_prefill_ragged_cpu = attention_prefill_ragged_cpu
    try:
        yield
    finally:
        kv_cache._attention_prefill_ragged_cpu = original
