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

The three differ only in where a query's keys lie and how work is split;
`_attend`, the loop over a query's blocks of keys, is written once and
expanded into each (TVMScript macros are inlined when the kernel is parsed).
Each signature lists its arguments one role to a line: queries, keys and
values or pages, rotary positions, outputs, scalars.

Queries and keys arrive with RoPE already applied (the model uses
`RopeMode.NORMAL`), so the kernels ignore their rotary arguments. TVM 0.27
builds its CPU KV pages 16 tokens long whatever the runtime page size, and
so do these kernels.
"""

from __future__ import annotations

import contextlib
import math

from tvm import tirx
from tvm.script import tirx as T

_LOG2E = math.log2(math.exp(1))
_KEY_BLOCK = 16
_LANES = 8
#: the running maximum starts here rather than at -inf, so exp2 of a
#: difference of two maxima is never exp2(inf - inf)
_NO_SCORE = -5e4


@T.macro
def _attend(q, row, h, group_size, first, visible, block_len, block_at, key, value, sm_scale, output, lse):
    """Attention of query `q[row, h]` over keys `first` to `visible` (not
    included) of its sequence, written to `output[row, h]` and `lse[row, h]`.

    The keys come in blocks of `block_len`: `block_at(p)` locates block `p`
    (a page number, or the row of the block's first key), and
    `key(block, j, kv_head, i)` and `value(...)` read element `i` of key or
    value `j` of that block; key `p * block_len + j` is the sequence's. Scores are kept in the log2 domain; what was
    summed under an old maximum is rescaled once per block. A query that
    sees no key gets zeros and the empty score.
    """
    scores = T.sblock_alloc_buffer((block_len,), "float32", scope="local")
    acc = T.sblock_alloc_buffer((output.shape[2],), "float32", scope="local")
    partial = T.sblock_alloc_buffer((_LANES,), "float32", scope="local")
    # running maximum, running denominator, maximum of the block at hand
    state = T.sblock_alloc_buffer((3,), "float32", scope="local")
    h_kv: T.let[T.int32] = h // group_size
    scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
    state[0] = T.float32(_NO_SCORE)
    state[1] = T.float32(0)
    for i in T.vectorized(output.shape[2]):
        acc[i] = T.float32(0)
    for p in T.serial(first // block_len, (T.max(visible, 0) + block_len - 1) // block_len):
        block: T.let[T.int32] = block_at(p)
        state[2] = state[0]
        for j in T.serial(block_len):
            if p * block_len + j >= first and p * block_len + j < visible:
                for lane in T.vectorized(_LANES):
                    partial[lane] = T.float32(0)
                for c in T.serial(q.shape[2] // _LANES):
                    for lane in T.vectorized(_LANES):
                        partial[lane] = partial[lane] + T.Cast("float32", q[row, h, c * _LANES + lane]) * T.Cast(
                            "float32", key(block, j, h_kv, c * _LANES + lane)
                        )
                scores[j] = (
                    (partial[0] + partial[1]) + (partial[2] + partial[3])
                    + ((partial[4] + partial[5]) + (partial[6] + partial[7]))
                ) * scale
                state[2] = T.max(state[2], scores[j])
        for i in T.vectorized(output.shape[2]):
            acc[i] = acc[i] * T.exp2(state[0] - state[2])
        state[1] = state[1] * T.exp2(state[0] - state[2])
        state[0] = state[2]
        for j in T.serial(block_len):
            if p * block_len + j >= first and p * block_len + j < visible:
                scores[j] = T.exp2(scores[j] - state[0])
                state[1] = state[1] + scores[j]
                for i in T.vectorized(output.shape[2]):
                    acc[i] = acc[i] + scores[j] * T.Cast("float32", value(block, j, h_kv, i))
    if state[1] > T.float32(0):
        for i in T.vectorized(output.shape[2]):
            output[row, h, i] = T.Cast(output.dtype, acc[i] / state[1])
        lse[row, h] = state[0] + T.log2(state[1])
    else:
        for i in T.vectorized(output.shape[2]):
            output[row, h, i] = T.Cast(output.dtype, T.float32(0))
        lse[row, h] = T.float32(_NO_SCORE)


@T.macro
def _attend_prefill(b, work, q_indptr, kv_len, causal, q, group_size, block_len, block_at, key, value, sm_scale, output, lse):
    """Work item `work` of sequence `b` in a prefill chunk: `_attend` for
    query `work % q_len` of the sequence and head `work // q_len`, heads
    outermost so each thread gets whole heads and the causal triangle's
    work splits evenly. The chunk's queries are the last of the
    sequence's `kv_len` keys."""
    q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
    row: T.let[T.int32] = work % q_len
    h: T.let[T.int32] = work // q_len
    q_row: T.let[T.int32] = q_indptr[b] + row
    kv_len_b: T.let[T.int32] = kv_len
    visible: T.let[T.int32] = T.if_then_else(causal > 0, T.min(kv_len_b - q_len + row + 1, kv_len_b), kv_len_b)
    _attend(q, q_row, h, group_size, 0, visible, block_len, block_at, key, value, sm_scale, output, lse)


@T.macro
def _attend_window(b, work, q_indptr, first, end, window, causal, q, group_size, block_len, block_at, key, value, sm_scale, output, lse):
    """Work item `work` of sequence `b` of a prefill chunk, in a layer of
    sliding-window attention, over the cached keys `first` to `end` (the
    window the cache keeps before the chunk): query `row` of the chunk sees
    the last `window - row - 1` of them (the chunk's own keys, all within
    the window as long as the chunk is no longer than it, go through the
    ragged kernel)."""
    q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
    row: T.let[T.int32] = work % q_len
    h: T.let[T.int32] = work // q_len
    start: T.let[T.int32] = T.if_then_else(causal > 0, T.max(end - T.max(window - row - 1, 0), first), first)
    _attend(q, q_indptr[b] + row, h, group_size, start, end, block_len, block_at, key, value, sm_scale, output, lse)


def _paged_cache(
    var_pages, var_page_indptr, var_page_values, var_length_info, batch_size, h_kv, page_size, d, dtype,
    sliding_window=False,
):
    """Declare the KV pages and the batch's page table, as the cache passes
    them to its paged kernels: (pages, page_indptr, page_values,
    length_info). Called while a kernel is parsed, like `T.match_buffer`.

    `length_info` is each sequence's last page length; for a layer of
    sliding-window attention it has three rows: the last page length, where
    the window starts in the first page it lists, and the attention sink
    (none: lockgate's windows have no sink).
    """
    max_num_pages, nnz_pages = tirx.Var("max_num_pages", "int32"), tirx.Var("nnz_pages", "int32")
    return (
        T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype),
        T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", offset_factor=1),
        T.match_buffer(var_page_values, (nnz_pages,), "int32", offset_factor=1),
        T.match_buffer(var_length_info, (3, batch_size) if sliding_window else (batch_size,), "int32", offset_factor=1),
    )


def _paged_kv_len(num_pages, last_page_len, page_size):
    """Keys a sequence holds in `num_pages` pages, the last `last_page_len` long."""
    return T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + last_page_len, 0)


def _length_readers(sliding_window: bool):
    """(last page length of sequence b, where its keys start in its first
    listed page), read from a kernel's `length_info` as `_paged_cache`
    declares it."""
    if sliding_window:
        return (lambda info, b: info[0, b]), (lambda info, b: info[1, b])
    return (lambda info, b: info[b]), (lambda info, b: 0)


def attention_prefill_ragged_cpu(h_kv, h_q, d_qk, d_v, dtype, rope_scaling):
    """Drop-in for `kv_cache._attention_prefill_ragged_cpu` (same arguments)."""
    group_size = h_q // h_kv
    assert d_qk % _LANES == 0, "head dimension must be a multiple of 8"
    blk = _KEY_BLOCK

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle,
        var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle,
        var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()

        q = T.match_buffer(var_q, (qo_len, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", offset_factor=1)
        k = T.match_buffer(var_k, (kv_len, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", offset_factor=1)
        # unused (RoPE is already applied), but the only argument whose shape binds batch_size
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", offset_factor=1)
        output = T.match_buffer(var_output, (qo_len, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        for b in T.serial(batch_size):
            for work in T.parallel(h_q * (q_indptr[b + 1] - q_indptr[b])):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], k[:, :, :], v[:, :, :], q_indptr[:], kv_indptr[:])
                    T.writes(output[:, :, :], lse[:, :])
                    _attend_prefill(
                        b, work, q_indptr, kv_indptr[b + 1] - kv_indptr[b], causal, q, group_size, blk,
                        lambda p: kv_indptr[b] + p * blk,
                        lambda first, j, head, i: k[first + j, head, i],
                        lambda first, j, head, i: v[first + j, head, i],
                        sm_scale, output, lse,
                    )

    return batch_prefill_ragged_kv


#: tokens per KV page: TVM 0.27 builds its CPU paged kernels (and its
#: page-copy kernels on every target) for this length whatever the runtime
#: asks, so the executor sizes its cache with it and reports it
#: (`TVMExecutor.page_size`); nothing else in lockgate names a page size
PAGE_SIZE = 16


def attention_decode_cpu(
    num_kv_heads, num_qo_heads, head_dim, qkv_dtype, sliding_window, rope_scaling, page_size=PAGE_SIZE
):
    """Drop-in for `kv_cache._attention_decode_cpu` (same arguments).

    The sliding-window variant serves the layers whose keys the cache keeps
    a window of (Gemma 3's local layers): each sequence's keys start
    `length_info[1, b]` into its first listed page, and all of them are
    within the window.
    """
    h_qo, h_kv, d = num_qo_heads, num_kv_heads, head_dim
    group_size = h_qo // h_kv
    assert d % _LANES == 0, "head dimension must be a multiple of 8"
    symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    last_page_len, window_start = _length_readers(sliding_window)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle, page_table_indptr_handle: T.handle, page_table_values_handle: T.handle, var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol})
        B = T.int32()

        Q = T.match_buffer(Q_handle, (B, h_qo, d), qkv_dtype)
        pages, page_table_indptr, page_table_values, length_info = _paged_cache(
            pages_handle, page_table_indptr_handle, page_table_values_handle, var_length_info,
            B, h_kv, page_size, d, qkv_dtype, sliding_window,
        )
        output = T.match_buffer(output_handle, (B, h_qo, d), qkv_dtype)
        lse = T.match_buffer(lse_handle, (B, h_qo), "float32")

        for work in T.parallel(B * h_qo):
            with T.sblock("attn"):
                T.reads(Q[:, :, :], pages[:, :, :, :, :], page_table_indptr[:], page_table_values[:], length_info[:])
                T.writes(output[:, :, :], lse[:, :])
                b: T.let[T.int32] = work // h_qo
                h: T.let[T.int32] = work % h_qo
                first_page: T.let[T.int32] = page_table_indptr[b]
                num_pages: T.let[T.int32] = page_table_indptr[b + 1] - first_page
                kv_len: T.let[T.int32] = _paged_kv_len(num_pages, last_page_len(length_info, b), page_size)
                _attend(
                    Q, b, h, group_size, window_start(length_info, b), kv_len, page_size,
                    lambda p: page_table_values[first_page + p],
                    lambda page, j, head, i: pages[page, 0, head, j, i],
                    lambda page, j, head, i: pages[page, 1, head, j, i],
                    sm_scale, output, lse,
                )

    return batch_decode_paged_kv


def attention_prefill_paged_cpu(
    h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=PAGE_SIZE, sliding_window_size=1024
):
    """Drop-in for `kv_cache._attention_prefill_cpu` (same arguments).

    It serves a prefill chunk's attention over what the cache already holds
    for its sequence (the chunk's own keys go through the ragged kernel).
    TVM's version walks the capacity of the whole cache for every query;
    this one walks the sequence's own pages. The sliding-window variant
    (`sliding_window_size` keys) serves the layers whose keys the cache
    keeps a window of: query `row` of the chunk sees the last
    `sliding_window_size - row - 1` cached keys (TVM's own variant misreads
    its running state on this path).
    """
    group_size = h_q // h_kv
    assert d % _LANES == 0, "head dimension must be a multiple of 8"
    symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    last_page_len, window_start = _length_readers(sliding_window)
    window = sliding_window_size if sliding_window else 0

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle, var_q_indptr: T.handle,
        var_pages: T.handle, var_page_indptr: T.handle, var_page_values: T.handle, var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle,
        var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol})
        batch_size = T.int32()
        total_len = T.int32()

        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", offset_factor=1)
        pages, page_indptr, page_values, length_info = _paged_cache(
            var_pages, var_page_indptr, var_page_values, var_length_info, batch_size, h_kv, page_size, d, dtype,
            sliding_window,
        )
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")

        for b in T.serial(batch_size):
            for work in T.parallel(h_q * (q_indptr[b + 1] - q_indptr[b])):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], pages[:, :, :, :, :], q_indptr[:], page_indptr[:], page_values[:], length_info[:])
                    T.writes(output[:, :, :], lse[:, :])
                    first_page: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                    kv_len: T.let[T.int32] = _paged_kv_len(num_pages, last_page_len(length_info, b), page_size)
                    if window > 0:
                        _attend_window(
                            b, work, q_indptr, window_start(length_info, b), kv_len, window, causal, q,
                            group_size, page_size,
                            lambda p: page_values[first_page + p],
                            lambda page, j, head, i: pages[page, 0, head, j, i],
                            lambda page, j, head, i: pages[page, 1, head, j, i],
                            sm_scale, output, lse,
                        )
                    else:
                        _attend_prefill(
                            b, work, q_indptr, kv_len, causal, q,
                            group_size, page_size,
                            lambda p: page_values[first_page + p],
                            lambda page, j, head, i: pages[page, 0, head, j, i],
                            lambda page, j, head, i: pages[page, 1, head, j, i],
                            sm_scale, output, lse,
                        )

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
