"""Parallel CPU kernels for the KV cache's attention: ragged prefill (a
chunk's own keys), paged prefill (a chunk against the cached prefix) and
paged decode.

TVM 0.27's `_attention_prefill_ragged_cpu`, `_attention_prefill_cpu` and
`_attention_decode_cpu` run every sequence, query and head serially with
scalar loops; the ragged one scores all n² (query, key) pairs and the paged
one walks the capacity of the whole cache for every query. The replacements keep their
signatures and output contract (attention output plus the log-sum-exp in the
log2 domain, so the cache's merge kernels still combine partial results)
and:

* run (head, query) or (sequence, head) pairs in parallel, heads outermost
  in prefill so each thread gets whole heads and the causal triangle's work
  splits evenly;
* visit only the keys the causal mask lets a query see;
* keep an online softmax over blocks of 16 keys (one KV page), so no score
  matrix is stored and the running sum is rescaled once per block;
* vectorize the q·k dot products and the weighted sum of values over the
  head dimension.

Queries and keys arrive with RoPE already applied (the model uses
`RopeMode.NORMAL`), so the kernels ignore their rotary arguments. TVM 0.27
builds its CPU KV pages 16 tokens long whatever the runtime page size, and
so do these kernels.
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


#: KV page length of TVM 0.27's CPU paged kernels (`page_size=16` defaults)
PAGE_SIZE = 16


def attention_decode_cpu(
    num_kv_heads, num_qo_heads, head_dim, qkv_dtype, sliding_window, rope_scaling, page_size=PAGE_SIZE
):
    """Drop-in for `kv_cache._attention_decode_cpu` (same arguments).

    The sliding-window variant, which lockgate's cache never enables, is
    left to TVM's own kernel.
    """
    if sliding_window:
        return _ORIGINAL["decode"](
            num_kv_heads, num_qo_heads, head_dim, qkv_dtype, sliding_window, rope_scaling, page_size
        )
    h_qo, h_kv, d = num_qo_heads, num_kv_heads, head_dim
    group_size = h_qo // h_kv
    assert d % _LANES == 0, "head dimension must be a multiple of 8"
    chunks = d // _LANES

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_decode_paged_kv_cpu"})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, h_qo, d), qkv_dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), qkv_dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, h_qo, d), qkv_dtype)
        lse = T.match_buffer(lse_handle, (B, h_qo), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

        for work in T.parallel(B * h_qo):
            with T.sblock("attn"):
                T.reads(Q[:, :, :], pages[:, :, :, :, :], page_table_indptr[:], page_table_values[:], last_page_len[:])
                T.writes(output[:, :, :], lse[:, :])
                scores = T.sblock_alloc_buffer((page_size,), "float32", scope="local")
                acc = T.sblock_alloc_buffer((d,), "float32", scope="local")
                partial = T.sblock_alloc_buffer((_LANES,), "float32", scope="local")
                state = T.sblock_alloc_buffer((3,), "float32", scope="local")
                b: T.let[T.int32] = work // h_qo
                h: T.let[T.int32] = work % h_qo
                h_kv_idx: T.let[T.int32] = h // group_size
                first_page: T.let[T.int32] = page_table_indptr[b]
                num_pages: T.let[T.int32] = page_table_indptr[b + 1] - first_page
                scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
                state[0] = T.float32(-5e4)
                state[1] = T.float32(0)
                for i in T.vectorized(d):
                    acc[i] = T.float32(0)
                for p in T.serial(num_pages):
                    page_no: T.let[T.int32] = page_table_values[first_page + p]
                    rows: T.let[T.int32] = T.if_then_else(p == num_pages - 1, last_page_len[b], page_size)
                    state[2] = state[0]
                    for j in T.serial(page_size):
                        if j < rows:
                            for lane in T.vectorized(_LANES):
                                partial[lane] = T.float32(0)
                            for c in T.serial(chunks):
                                for lane in T.vectorized(_LANES):
                                    partial[lane] = partial[lane] + T.Cast(
                                        "float32", Q[b, h, c * _LANES + lane]
                                    ) * T.Cast("float32", pages[page_no, 0, h_kv_idx, j, c * _LANES + lane])
                            scores[j] = (
                                (partial[0] + partial[1]) + (partial[2] + partial[3])
                                + ((partial[4] + partial[5]) + (partial[6] + partial[7]))
                            ) * scale
                            state[2] = T.max(state[2], scores[j])
                    for i in T.vectorized(d):
                        acc[i] = acc[i] * T.exp2(state[0] - state[2])
                    state[1] = state[1] * T.exp2(state[0] - state[2])
                    state[0] = state[2]
                    for j in T.serial(page_size):
                        if j < rows:
                            scores[j] = T.exp2(scores[j] - state[0])
                            state[1] = state[1] + scores[j]
                            for i in T.vectorized(d):
                                acc[i] = acc[i] + scores[j] * T.Cast(
                                    "float32", pages[page_no, 1, h_kv_idx, j, i]
                                )
                if state[1] > T.float32(0):
                    for i in T.vectorized(d):
                        output[b, h, i] = T.Cast(qkv_dtype, acc[i] / state[1])
                    lse[b, h] = state[0] + T.log2(state[1])
                else:
                    for i in T.vectorized(d):
                        output[b, h, i] = T.Cast(qkv_dtype, T.float32(0))
                    lse[b, h] = T.float32(-5e4)

    return batch_decode_paged_kv


def attention_prefill_paged_cpu(
    h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=PAGE_SIZE, sliding_window_size=1024
):
    """Drop-in for `kv_cache._attention_prefill_cpu` (same arguments).

    It serves a prefill chunk's attention over what the cache already holds
    for its sequence (the chunk's own keys go through the ragged kernel).
    TVM's version walks the capacity of the whole cache for every query;
    this one walks the sequence's own pages. The sliding-window variant is
    left to TVM.
    """
    if sliding_window:
        return _ORIGINAL["prefill_paged"](
            h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size, sliding_window_size
        )
    group_size = h_q // h_kv
    assert d % _LANES == 0, "head dimension must be a multiple of 8"
    chunks = d // _LANES

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_prefill_paged_kv_cpu"})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        last_page_len = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)

        for b in T.serial(batch_size):
            for work in T.parallel(h_q * (q_indptr[b + 1] - q_indptr[b])):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], pages[:, :, :, :, :], q_indptr[:], page_indptr[:], page_values[:], last_page_len[:])
                    T.writes(output[:, :, :], lse[:, :])
                    scores = T.sblock_alloc_buffer((page_size,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((d,), "float32", scope="local")
                    partial = T.sblock_alloc_buffer((_LANES,), "float32", scope="local")
                    state = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    q_len_b: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    h: T.let[T.int32] = work // q_len_b
                    row: T.let[T.int32] = work % q_len_b
                    h_kv_idx: T.let[T.int32] = h // group_size
                    q_row: T.let[T.int32] = q_indptr[b] + row
                    first_page: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                    kv_len_b: T.let[T.int32] = T.if_then_else(
                        num_pages > 0, (num_pages - 1) * page_size + last_page_len[b], 0
                    )
                    visible: T.let[T.int32] = T.if_then_else(
                        causal > 0, T.min(kv_len_b - q_len_b + row + 1, kv_len_b), kv_len_b
                    )
                    scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
                    state[0] = T.float32(-5e4)
                    state[1] = T.float32(0)
                    for i in T.vectorized(d):
                        acc[i] = T.float32(0)
                    for p in T.serial((T.max(visible, 0) + page_size - 1) // page_size):
                        page_no: T.let[T.int32] = page_values[first_page + p]
                        state[2] = state[0]
                        for j in T.serial(page_size):
                            if p * page_size + j < visible:
                                for lane in T.vectorized(_LANES):
                                    partial[lane] = T.float32(0)
                                for c in T.serial(chunks):
                                    for lane in T.vectorized(_LANES):
                                        partial[lane] = partial[lane] + T.Cast(
                                            "float32", q[q_row, h, c * _LANES + lane]
                                        ) * T.Cast("float32", pages[page_no, 0, h_kv_idx, j, c * _LANES + lane])
                                scores[j] = (
                                    (partial[0] + partial[1]) + (partial[2] + partial[3])
                                    + ((partial[4] + partial[5]) + (partial[6] + partial[7]))
                                ) * scale
                                state[2] = T.max(state[2], scores[j])
                        for i in T.vectorized(d):
                            acc[i] = acc[i] * T.exp2(state[0] - state[2])
                        state[1] = state[1] * T.exp2(state[0] - state[2])
                        state[0] = state[2]
                        for j in T.serial(page_size):
                            if p * page_size + j < visible:
                                scores[j] = T.exp2(scores[j] - state[0])
                                state[1] = state[1] + scores[j]
                                for i in T.vectorized(d):
                                    acc[i] = acc[i] + scores[j] * T.Cast("float32", pages[page_no, 1, h_kv_idx, j, i])
                    if state[1] > T.float32(0):
                        for i in T.vectorized(d):
                            output[q_row, h, i] = T.Cast(dtype, acc[i] / state[1])
                        lse[q_row, h] = state[0] + T.log2(state[1])
                    else:
                        for i in T.vectorized(d):
                            output[q_row, h, i] = T.Cast(dtype, T.float32(0))
                        lse[q_row, h] = T.float32(-5e4)

    return batch_prefill_paged_kv_cpu


_ORIGINAL: dict = {}


@contextlib.contextmanager
def cpu_attention_kernels():
    """Have `TIRPagedKVCache` build the parallel kernel while in the block.

    The cache looks its kernel factories up as module globals when it is
    constructed, so the swap is confined to the export that happens here.
    """
    from tvm.relax.frontend.nn.llm import kv_cache

    replacements = {
        "_attention_prefill_ragged_cpu": ("prefill_ragged", attention_prefill_ragged_cpu),
        "_attention_prefill_cpu": ("prefill_paged", attention_prefill_paged_cpu),
        "_attention_decode_cpu": ("decode", attention_decode_cpu),
    }
    for attr, (key, kernel) in replacements.items():
        _ORIGINAL.setdefault(key, getattr(kv_cache, attr))
        setattr(kv_cache, attr, kernel)
    try:
        yield
    finally:
        for attr, (key, _) in replacements.items():
            setattr(kv_cache, attr, _ORIGINAL[key])
