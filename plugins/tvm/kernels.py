"""Parallel CPU kernels for the KV cache's attention: ragged prefill (a
chunk's own keys), paged prefill (a chunk against the cached prefix) and
paged decode.

TVM 0.27's `_attention_prefill_ragged_cpu`, `_attention_prefill_cpu` and
`_attention_decode_cpu` run every sequence, query and head serially with
scalar loops; the ragged one scores all n² (query, key) pairs and the paged
one walks the capacity of the whole cache for every query. The replacements keep their
signatures and output contract (attention output plus the log-sum-exp in the
log2 domain, so the cache's merge kernels still combine partial results),
visit only the keys the causal mask (or the sliding window) lets a query
see, and keep an online softmax over blocks of 16 keys (one KV page), so no
score matrix is stored and the running sum is rescaled once per block.

Prefill (`_attend_tile`) first copies the keys it will read, transposed and
in float32, into a workspace (`_transpose_keys`: the chunk's own keys, or
the listed pages), so a block's 16 scores for a query are the lanes of one
vector, built by one multiply-add per feature, with no horizontal sums;
four queries of one head share each load of keys and values, and the
exponentials are a vectorized polynomial (`exp2_approx`) rather than a libm call
per score. A score is two sums, over each half of the features: one sum
of all 64 drifted further from the exact dot product than the decode
kernel's eight lanes, enough to move greedy logprobs of a prompt read from
the prefix cache 60 % further from those of the same prompt computed
whole. (Head, query tile) pairs run in parallel, heads outermost, so
each thread gets whole heads and the causal triangle's work splits evenly.
A default-model layer's 256-token prefill went from 2.1 to 1.4 ms on two
threads (1.1 with one sum).

Decode (`_attend`) has one query per (sequence, head) and reads each key
once, so it keeps the keys where they are: (sequence, head) pairs in
parallel, the q·k dot products and the weighted sum of values vectorized
over the head dimension.

Each kernel's signature lists its arguments one role to a line: queries,
keys and values or pages, rotary positions, outputs, scalars.

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
#: queries of one head that share each block of keys and values in prefill
_QUERY_TILE = 4
#: 2**f for f in [0, 1): 1 + c1 f + … + c6 f**6, fitted to relative error
_EXP2_POLY = (
    0.6931470281974899, 0.2402294001878477, 0.05548532248003533, 0.009674545854517918,
    0.0012482881915386035, 0.00021540509294804773,
)


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


def exp2_approx(x):
    """2**x in float32, as an expression that vectorizes (LLVM turns
    `T.exp2` or `T.exp` of a vector into a libm call per lane): 2**floor(x)
    from the exponent bits times a degree-6 polynomial for the fraction
    (relative error 1e-7, float32's rounding); below -126 it is 0, as
    float32's exp2 nearly is, and above 126 it stays at 2**126."""
    clamped = T.min(T.max(x, T.float32(-127.0)), T.float32(126.0))
    whole = T.floor(clamped)
    fraction = clamped - whole
    poly = T.float32(_EXP2_POLY[-1])
    for c in (*reversed(_EXP2_POLY[:-1]), 1.0):
        poly = poly * fraction + T.float32(c)
    power = T.reinterpret("float32", T.shift_left(T.Cast("int32", whole) + 127, 23))
    return T.if_then_else(x > T.float32(-126.0), power * poly, T.float32(0.0))


def _max16(s, r):
    """The largest of `s[r, 0:16]`, folded pairwise."""
    m = [s[r, j] for j in range(_KEY_BLOCK)]
    while len(m) > 1:
        m = [T.max(m[i], m[i + 1]) for i in range(0, len(m), 2)]
    return m[0]


def _sum16(s, r):
    """The sum of `s[r, 0:16]`, folded pairwise."""
    m = [s[r, j] for j in range(_KEY_BLOCK)]
    while len(m) > 1:
        m = [m[i] + m[i + 1] for i in range(0, len(m), 2)]
    return m[0]


@T.macro
def _attend_tile(q, q_base, row0, rows, h, group_size, first_of, end_of, keys_t, column, value, sm_scale, output, lse):
    """Attention of the `_QUERY_TILE` queries `row0`, `row0 + 1`, … (those
    below `rows`) of head `h` of one sequence, whose query `row` is
    `q[q_base + row]` and sees its keys `first_of(row)` to `end_of(row)`, written
    to `output` and `lse` at the same rows.

    Keys come in blocks of 16: block `p` holds keys 16p … 16p + 15, read
    transposed and in float32 from `keys_t[kv_head, i, column(p) + j]`, so
    a block's scores for a query are 16 lanes of one vector; the tile's
    queries share each load of it, and of `value(p, j, kv_head, i)`. Scores
    are kept in the log2 domain, and what was summed under an old maximum
    is rescaled once per block. A query that sees no key gets zeros and the
    empty score.
    """
    qf = T.sblock_alloc_buffer((_QUERY_TILE, q.shape[2]), "float32", scope="local")
    acc = T.sblock_alloc_buffer((_QUERY_TILE, output.shape[2]), "float32", scope="local")
    s = T.sblock_alloc_buffer((_QUERY_TILE, _KEY_BLOCK), "float32", scope="local")
    s_high = T.sblock_alloc_buffer((_QUERY_TILE, _KEY_BLOCK), "float32", scope="local")
    # per query: running maximum, running denominator
    state = T.sblock_alloc_buffer((_QUERY_TILE, 2), "float32", scope="local")
    # per query: first and end of its keys; then the tile's first and end
    seen = T.sblock_alloc_buffer((_QUERY_TILE + 1, 2), "int32", scope="local")
    h_kv: T.let[T.int32] = h // group_size
    scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
    seen[_QUERY_TILE, 0] = T.int32(2**30)
    seen[_QUERY_TILE, 1] = T.int32(0)
    for r in T.unroll(_QUERY_TILE):
        # a row past the end repeats the last one and is not written
        row: T.let[T.int32] = T.min(row0 + r, rows - 1)
        seen[r, 0] = first_of(row)
        seen[r, 1] = end_of(row)
        seen[_QUERY_TILE, 0] = T.min(seen[_QUERY_TILE, 0], seen[r, 0])
        seen[_QUERY_TILE, 1] = T.max(seen[_QUERY_TILE, 1], seen[r, 1])
        for i in T.vectorized(q.shape[2]):
            qf[r, i] = T.Cast("float32", q[q_base + row, h, i]) * scale
        for i in T.vectorized(output.shape[2]):
            acc[r, i] = T.float32(0)
        state[r, 0] = T.float32(_NO_SCORE)
        state[r, 1] = T.float32(0)
    tile_first: T.let[T.int32] = seen[_QUERY_TILE, 0]
    tile_end: T.let[T.int32] = seen[_QUERY_TILE, 1]
    for p in T.serial(tile_first // _KEY_BLOCK, (T.max(tile_end, 0) + _KEY_BLOCK - 1) // _KEY_BLOCK):
        col: T.let[T.int32] = column(p)
        for r in T.unroll(_QUERY_TILE):
            for j in T.vectorized(_KEY_BLOCK):
                s[r, j] = T.float32(0)
                s_high[r, j] = T.float32(0)
        # two sums, of the first and the second half of the features, as
        # accurate as the decode kernel's lanes (one sum of all drifts further)
        for c in T.serial(q.shape[2] // 2):
            for r in T.unroll(_QUERY_TILE):
                for j in T.vectorized(_KEY_BLOCK):
                    s[r, j] = s[r, j] + qf[r, c] * keys_t[h_kv, c, col + j]
                    s_high[r, j] = s_high[r, j] + qf[r, c + q.shape[2] // 2] * keys_t[h_kv, c + q.shape[2] // 2, col + j]
        for r in T.unroll(_QUERY_TILE):
            for j in T.vectorized(_KEY_BLOCK):
                s[r, j] = s[r, j] + s_high[r, j]
        for r in T.unroll(_QUERY_TILE):
            if p * _KEY_BLOCK + _KEY_BLOCK > seen[r, 0] and p * _KEY_BLOCK < seen[r, 1]:
                for j in T.vectorized(_KEY_BLOCK):
                    s[r, j] = T.if_then_else(
                        p * _KEY_BLOCK + j >= seen[r, 0] and p * _KEY_BLOCK + j < seen[r, 1], s[r, j], T.float32(_NO_SCORE)
                    )
                top: T.let[T.float32] = T.max(state[r, 0], _max16(s, r))
                rescale: T.let[T.float32] = exp2_approx(state[r, 0] - top)
                for i in T.vectorized(output.shape[2]):
                    acc[r, i] = acc[r, i] * rescale
                state[r, 0] = top
                for j in T.vectorized(_KEY_BLOCK):
                    s[r, j] = exp2_approx(s[r, j] - top)
                state[r, 1] = state[r, 1] * rescale + _sum16(s, r)
            else:
                for j in T.vectorized(_KEY_BLOCK):
                    s[r, j] = T.float32(0)
        # only keys some query sees: the others may be unwritten memory
        j_first: T.let[T.int32] = T.max(tile_first - p * _KEY_BLOCK, 0)
        j_end: T.let[T.int32] = T.min(tile_end - p * _KEY_BLOCK, _KEY_BLOCK)
        for c in T.serial(output.shape[2] // _KEY_BLOCK):
            for j in T.serial(j_first, j_end):
                for r in T.unroll(_QUERY_TILE):
                    for i in T.vectorized(_KEY_BLOCK):
                        acc[r, c * _KEY_BLOCK + i] = acc[r, c * _KEY_BLOCK + i] + s[r, j] * T.Cast(
                            "float32", value(p, j, h_kv, c * _KEY_BLOCK + i)
                        )
    for r in T.unroll(_QUERY_TILE):
        if row0 + r < rows:
            if state[r, 1] > T.float32(0):
                for i in T.vectorized(output.shape[2]):
                    output[q_base + row0 + r, h, i] = T.Cast(output.dtype, acc[r, i] / state[r, 1])
                lse[q_base + row0 + r, h] = state[r, 0] + T.log2(state[r, 1])
            else:
                for i in T.vectorized(output.shape[2]):
                    output[q_base + row0 + r, h, i] = T.Cast(output.dtype, T.float32(0))
                lse[q_base + row0 + r, h] = T.float32(_NO_SCORE)


@T.macro
def _attend_chunk(b, work, q_indptr, q, group_size, span, keys_t, column, value, sm_scale, output, lse):
    """Work item `work` of sequence `b` in a prefill chunk: `_attend_tile`
    for the `work % tiles`-th tile of its queries and head `work // tiles`,
    heads outermost so each thread gets whole heads and the causal
    triangle's work splits evenly."""
    q_first: T.let[T.int32] = q_indptr[b]
    q_len: T.let[T.int32] = q_indptr[b + 1] - q_first
    tiles: T.let[T.int32] = (q_len + _QUERY_TILE - 1) // _QUERY_TILE
    head: T.let[T.int32] = work // tiles
    row0: T.let[T.int32] = (work % tiles) * _QUERY_TILE
    _attend_tile(
        q, q_first, row0, q_len, head, group_size, span[0], span[1], keys_t, column, value, sm_scale, output, lse
    )


@T.macro
def _transpose_keys(columns, keys_t, key):
    """Fill `keys_t[kv_head, i, t]` with `key(t, kv_head, i)` for t below
    `columns`, in parallel over t."""
    for t in T.parallel(columns):
        with T.sblock("transpose_keys"):
            for head in T.serial(keys_t.shape[0]):
                for i in T.serial(keys_t.shape[1]):
                    keys_t[head, i, t] = key(t, head, i)


def _chunk_work(q_indptr, b, h_q):
    """Work items of sequence b in a prefill chunk: heads times query tiles."""
    return h_q * ((q_indptr[b + 1] - q_indptr[b] + _QUERY_TILE - 1) // _QUERY_TILE)


def _causal_span(kv_len, q_len, causal):
    """(first, end): the first of the keys query `row` of a chunk sees, and
    the end, the chunk's queries being the last of the sequence's `kv_len`
    keys."""
    return (lambda row: 0), (lambda row: T.if_then_else(causal > 0, T.min(kv_len - q_len + row + 1, kv_len), kv_len))


def _window_span(first, end, window, causal):
    """(first, end) as `_causal_span`, of the cached keys `first` to `end` query `row` of a
    chunk sees in a layer of sliding-window attention: the last
    `window - row - 1` of them (the chunk's own keys, all within the window
    as long as the chunk is no longer than it, go through the ragged
    kernel)."""
    return (lambda row: T.if_then_else(causal > 0, T.max(end - T.max(window - row - 1, 0), first), first)), (lambda row: end)


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
    assert d_v % _KEY_BLOCK == 0, "head dimension must be a multiple of 16"
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
        # the keys transposed, in float32, and a block of zeros past the last
        keys_t = T.alloc_buffer((h_kv, d_qk, kv_len + blk), "float32")

        _transpose_keys(kv_len + blk, keys_t, lambda t, head, i: T.if_then_else(
            t < kv_len, T.Cast("float32", k[T.min(t, kv_len - 1), head, i]), T.float32(0)
        ))
        for b in T.serial(batch_size):
            for work in T.parallel(_chunk_work(q_indptr, b, h_q)):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], keys_t[:, :, :], v[:, :, :], q_indptr[:], kv_indptr[:])
                    T.writes(output[:, :, :], lse[:, :])
                    kv_first: T.let[T.int32] = kv_indptr[b]
                    _attend_chunk(
                        b, work, q_indptr, q, group_size,
                        _causal_span(kv_indptr[b + 1] - kv_first, q_indptr[b + 1] - q_indptr[b], causal),
                        keys_t, lambda p: kv_first + p * blk,
                        lambda p, j, head, i: v[kv_first + p * blk + j, head, i],
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
    assert d % _KEY_BLOCK == 0, "head dimension must be a multiple of 16"
    symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    last_page_len, window_start = _length_readers(sliding_window)
    window = sliding_window_size if sliding_window else 0

    def span_of(first, kv_len, q_len, causal):
        if window > 0:
            return _window_span(first, kv_len, window, causal)
        return _causal_span(kv_len, q_len, causal)

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

        # the keys of the listed pages transposed, in float32: page slot n's key j in column 16n + j
        keys_t = T.alloc_buffer((h_kv, d, page_values.shape[0] * page_size), "float32")

        _transpose_keys(page_values.shape[0] * page_size, keys_t, lambda t, head, i: T.Cast(
            "float32", pages[page_values[t // page_size], 0, head, t % page_size, i]
        ))
        for b in T.serial(batch_size):
            for work in T.parallel(_chunk_work(q_indptr, b, h_q)):
                with T.sblock("attn"):
                    T.reads(q[:, :, :], keys_t[:, :, :], pages[:, :, :, :, :], q_indptr[:], page_indptr[:], page_values[:], length_info[:])
                    T.writes(output[:, :, :], lse[:, :])
                    first_page: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                    kv_len: T.let[T.int32] = _paged_kv_len(num_pages, last_page_len(length_info, b), page_size)
                    q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    _attend_chunk(
                        b, work, q_indptr, q, group_size,
                        span_of(window_start(length_info, b), kv_len, q_len, causal),
                        keys_t, lambda p: (first_page + p) * page_size,
                        lambda p, j, head, i: pages[page_values[first_page + p], 1, head, j, i],
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
