"""The CPU's KV cache at compile time: lockgate's own paged attention.

On the CPU the compiled model keeps its keys and values in two pools of
16-token pages that the executor owns (`page_pool.PagePool` hands out the
pages and builds each step's page tables), not in TVM's `PagedKVCache`.
TVM's cache splits a query's keys where it stored them: a prefill chunk's
own keys go through one kernel and the cached prefix through another, and
a forked sequence's shared pages through a third, and it merges the partial
results in float16. A prompt read from the prefix cache was therefore
attended in other pieces than the same prompt prefilled whole, and greedy
answers parted from the third decimal of a logprob on.

Here every step first appends its keys and values to their pages
(`append_kv`), then each query attends over its sequence's whole page list
in one pass (`attend_prefill`, `attend_decode`): blocks of 16 keys, one
page each, in the order of their positions, with one online softmax. What
a query computes depends on its own values and the keys before it, never on
where they were cached, how the prompt was chunked, which other sequences
share the step, or whether the step is a prefill or a decode: the two
kernels run the same arithmetic per query (`_attend_lanes`), so a token
computed in a decode step equals the same token computed in a prefill.

Keys are stored feature-major within a page (`k_pool[layer, page, kv_head,
feature, slot]`) so that one feature of a block's 16 keys is one vector:
a block's scores are built by one multiply-add per feature for up to four
queries at once (four query positions of one head in prefill; the query
heads of one KV head in decode), with no transposed copy of the keys and
no horizontal sums. A score is two sums, over each half of the features
(one sum of all of them drifts further from the exact dot product).
Values are slot-major (`v_pool[layer, page, kv_head, slot, feature]`), so a
weighted sum of them is vectorized over the features.

`CPUPagedKV` is the object the model's attention layers call
(`attention_with_fused_qkv`, `get_query_positions`, as TVM's cache is
called): it splits the fused Q/K/V, rotates Q and K (unless the model does,
as Gemma 3), appends and attends, threading the pools through the layers as
in-place updates.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import tirx
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from lockgate.plugins.tvm.page_pool import PAGE_SIZE
from lockgate.plugins.tvm.rope import split_rotate_cpu

_LOG2E = math.log2(math.exp(1))
#: the running maximum starts here rather than at -inf, so exp2 of a
#: difference of two maxima is never exp2(inf - inf)
_NO_SCORE = -5e4
#: queries that share each block of keys and values
_LANES = 4
#: 2**f for f in [0, 1): 1 + c1 f + … + c6 f**6, fitted to relative error
_EXP2_POLY = (
    0.6931470281974899, 0.2402294001878477, 0.05548532248003533, 0.009674545854517918,
    0.0012482881915386035, 0.00021540509294804773,
)


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


def _fold(values, combine):
    while len(values) > 1:
        values = [combine(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def _max16(s, r):
    """The largest of `s[r, 0:16]`, folded pairwise."""
    return _fold([s[r, j] for j in range(PAGE_SIZE)], T.max)


def _sum16(s, r):
    """The sum of `s[r, 0:16]`, folded pairwise."""
    return _fold([s[r, j] for j in range(PAGE_SIZE)], lambda a, b: a + b)


def _window_start(window: int):
    """The first key position a query whose keys end at `end` sees."""
    if window:
        return lambda end: T.max(end - window, 0)
    return lambda end: 0


@T.macro
def _attend_lanes(width, q, d, half, lane_row, lane_head, lanes, h_kv, first_page, num_pages, positions, start,
                  k_pool, v_pool, layer, page_values, sm_scale, output):
    """Attention of up to `width` (1 or `_LANES`) queries that share a KV head `h_kv` and a
    sequence (its pages `page_values[first_page : first_page + num_pages]`):
    lane `r` below `lanes` is query row `lane_row(r)` of head `lane_head(r)`,
    at position `positions[lane_row(r)]`, and sees the keys at positions
    `start(end)` to its own (`end` the one after it: a sliding window's start,
    or 0). Lanes at or past `lanes` repeat the last one and are not written.

    What a lane computes is the same whatever the other lanes are: a block
    none of a lane's keys are in leaves its state as it was, and a key it
    does not see weighs exactly zero."""
    qf = T.sblock_alloc_buffer((width, d), "float32", scope="local")
    acc = T.sblock_alloc_buffer((width, d), "float32", scope="local")
    s = T.sblock_alloc_buffer((width, PAGE_SIZE), "float32", scope="local")
    s_high = T.sblock_alloc_buffer((width, PAGE_SIZE), "float32", scope="local")
    # per lane: running maximum, running denominator
    state = T.sblock_alloc_buffer((width, 2), "float32", scope="local")
    # per lane: first and end of its keys; then the lanes' first and end
    seen = T.sblock_alloc_buffer((width + 1, 2), "int32", scope="local")
    scale: T.let[T.float32] = sm_scale * T.float32(_LOG2E)
    seen[width, 0] = T.int32(2**30)
    seen[width, 1] = T.int32(0)
    for r in T.unroll(width):
        lane: T.let[T.int32] = T.min(r, lanes - 1)
        row: T.let[T.int32] = lane_row(lane)
        head: T.let[T.int32] = lane_head(lane)
        seen[r, 1] = positions[row] + 1
        seen[r, 0] = start(seen[r, 1])
        seen[width, 0] = T.min(seen[width, 0], seen[r, 0])
        seen[width, 1] = T.max(seen[width, 1], seen[r, 1])
        for i in T.vectorized(d):
            qf[r, i] = T.Cast("float32", q[row, head, i]) * scale
        for i in T.vectorized(d):
            acc[r, i] = T.float32(0)
        state[r, 0] = T.float32(_NO_SCORE)
        state[r, 1] = T.float32(0)
    lanes_first: T.let[T.int32] = seen[width, 0]
    lanes_end: T.let[T.int32] = T.min(seen[width, 1], num_pages * PAGE_SIZE)
    for p in T.serial(lanes_first // PAGE_SIZE, (lanes_end + PAGE_SIZE - 1) // PAGE_SIZE):
        page: T.let[T.int32] = page_values[first_page + p]
        for r in T.unroll(width):
            for j in T.vectorized(PAGE_SIZE):
                s[r, j] = T.float32(0)
                s_high[r, j] = T.float32(0)
        for c in T.serial(half):
            for r in T.unroll(width):
                for j in T.vectorized(PAGE_SIZE):
                    s[r, j] = s[r, j] + qf[r, c] * T.Cast("float32", k_pool[layer, page, h_kv, c, j])
                    s_high[r, j] = s_high[r, j] + qf[r, c + half] * T.Cast(
                        "float32", k_pool[layer, page, h_kv, c + half, j])
        for r in T.unroll(width):
            for j in T.vectorized(PAGE_SIZE):
                s[r, j] = s[r, j] + s_high[r, j]
        for r in T.unroll(width):
            if p * PAGE_SIZE + PAGE_SIZE > seen[r, 0] and p * PAGE_SIZE < seen[r, 1]:
                for j in T.vectorized(PAGE_SIZE):
                    s[r, j] = T.if_then_else(
                        p * PAGE_SIZE + j >= seen[r, 0] and p * PAGE_SIZE + j < seen[r, 1], s[r, j],
                        T.float32(_NO_SCORE),
                    )
                top: T.let[T.float32] = T.max(state[r, 0], _max16(s, r))
                rescale: T.let[T.float32] = exp2_approx(state[r, 0] - top)
                for i in T.vectorized(d):
                    acc[r, i] = acc[r, i] * rescale
                state[r, 0] = top
                for j in T.vectorized(PAGE_SIZE):
                    s[r, j] = exp2_approx(s[r, j] - top)
                state[r, 1] = state[r, 1] * rescale + _sum16(s, r)
            else:
                for j in T.vectorized(PAGE_SIZE):
                    s[r, j] = T.float32(0)
        # only keys some lane sees: the slots past a sequence's end are not written
        j_first: T.let[T.int32] = T.max(lanes_first - p * PAGE_SIZE, 0)
        j_end: T.let[T.int32] = T.min(lanes_end - p * PAGE_SIZE, PAGE_SIZE)
        for c in T.serial(d // PAGE_SIZE):
            for j in T.serial(j_first, j_end):
                for r in T.unroll(width):
                    for i in T.vectorized(PAGE_SIZE):
                        acc[r, c * PAGE_SIZE + i] = acc[r, c * PAGE_SIZE + i] + s[r, j] * T.Cast(
                            "float32", v_pool[layer, page, h_kv, j, c * PAGE_SIZE + i])
    for r in T.unroll(width):
        if r < lanes:
            if state[r, 1] > T.float32(0):
                for i in T.vectorized(d):
                    output[lane_row(r), lane_head(r), i] = T.Cast(output.dtype, acc[r, i] / state[r, 1])
            else:
                for i in T.vectorized(d):
                    output[lane_row(r), lane_head(r), i] = T.Cast(output.dtype, T.float32(0))


def _pools(var_k_pool, var_v_pool, h_kv, d, kv_dtype):
    num_layers, num_pages = tirx.Var("num_layers", "int32"), tirx.Var("num_pages", "int32")
    return (
        T.match_buffer(var_k_pool, (num_layers, num_pages, h_kv, d, PAGE_SIZE), kv_dtype),
        T.match_buffer(var_v_pool, (num_layers, num_pages, h_kv, PAGE_SIZE, d), kv_dtype),
    )


def append_kv(h_kv: int, d: int, dtype: str, kv_dtype: str):
    """Write a step's keys and values (`k`, `v`: (tokens, kv heads, d)) to
    their slots (`slots[t]`: page * 16 + offset) of layer `layer`'s pages, in place."""

    @T.prim_func(s_tir=True)
    def append_kv(var_k_pool: T.handle, var_v_pool: T.handle, var_k: T.handle, var_v: T.handle,
                  var_slots: T.handle, layer: T.int32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int32()
        k_pool, v_pool = _pools(var_k_pool, var_v_pool, h_kv, d, kv_dtype)
        k = T.match_buffer(var_k, (n, h_kv, d), dtype)
        v = T.match_buffer(var_v, (n, h_kv, d), dtype)
        slots = T.match_buffer(var_slots, (n,), "int32")
        for t in T.parallel(n):
            with T.sblock("append"):
                T.reads(k[t, :, :], v[t, :, :], slots[t])
                T.writes(k_pool[layer, :, :, :, :], v_pool[layer, :, :, :, :])
                page: T.let[T.int32] = slots[t] // PAGE_SIZE
                slot: T.let[T.int32] = slots[t] % PAGE_SIZE
                for h in T.serial(h_kv):
                    for c in T.serial(d):
                        k_pool[layer, page, h, c, slot] = T.Cast(kv_dtype, k[t, h, c])
                    for c in T.vectorized(d):
                        v_pool[layer, page, h, slot, c] = T.Cast(kv_dtype, v[t, h, c])

    return append_kv


def attend_prefill(h_kv: int, h_q: int, d: int, dtype: str, kv_dtype: str, window: int = 0):
    """Attention of a prefill chunk's queries (`q`: (tokens, heads, d),
    sequence `b`'s rows `q_indptr[b]` to `q_indptr[b + 1]`) over their
    sequences' pages, which hold the chunk's own keys already. Work items
    are (head, tile of four consecutive queries), heads outermost so each
    thread gets whole heads and the causal triangle's work splits evenly."""
    group = h_q // h_kv
    start = _window_start(window)
    assert d % PAGE_SIZE == 0, "head dimension must be a multiple of 16"

    @T.prim_func(s_tir=True)
    def attend_prefill(var_q: T.handle, var_k_pool: T.handle, var_v_pool: T.handle, layer: T.int32,
                       var_q_indptr: T.handle, var_positions: T.handle, var_page_indptr: T.handle,
                       var_page_values: T.handle, sm_scale: T.float32, var_output: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        n, indptr_len, nnz = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (n, h_q, d), dtype)
        k_pool, v_pool = _pools(var_k_pool, var_v_pool, h_kv, d, kv_dtype)
        q_indptr = T.match_buffer(var_q_indptr, (indptr_len,), "int32")
        positions = T.match_buffer(var_positions, (n,), "int32")
        page_indptr = T.match_buffer(var_page_indptr, (indptr_len,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz,), "int32")
        output = T.match_buffer(var_output, (n, h_q, d), dtype)
        for b in T.serial(indptr_len - 1):
            for work in T.parallel(h_q * ((q_indptr[b + 1] - q_indptr[b] + _LANES - 1) // _LANES)):
                with T.sblock("attend"):
                    T.reads(q[:, :, :], k_pool[layer, :, :, :, :], v_pool[layer, :, :, :, :], q_indptr[:],
                            positions[:], page_indptr[:], page_values[:])
                    T.writes(output[:, :, :])
                    q_first: T.let[T.int32] = q_indptr[b]
                    q_len: T.let[T.int32] = q_indptr[b + 1] - q_first
                    tiles: T.let[T.int32] = (q_len + _LANES - 1) // _LANES
                    head: T.let[T.int32] = work // tiles
                    row0: T.let[T.int32] = q_first + (work % tiles) * _LANES
                    _attend_lanes(
                        _LANES, q, d, d // 2, lambda r: row0 + r, lambda r: head, T.min(_LANES, q_first + q_len - row0),
                        head // group, page_indptr[b], page_indptr[b + 1] - page_indptr[b], positions, start,
                        k_pool, v_pool, layer, page_values, sm_scale, output,
                    )

    return attend_prefill


#: decode batches of fewer (sequence, KV head) pairs than this give each
#: query head its own work item, so that two threads share even a batch of
#: one; larger ones let a group's heads share each load of the keys
_WIDE_DECODE = 8


def attend_decode(h_kv: int, h_q: int, d: int, dtype: str, kv_dtype: str, window: int = 0):
    """Attention of one query per sequence (`q`: (batch, heads, d)) over its
    pages. Work items are (sequence, KV head, up to four of the query heads
    that share it), so the heads of a group share each load of the keys;
    a batch of fewer than `_WIDE_DECODE` (sequence, KV head) pairs takes
    one query head an item instead, so that the threads share it. Either
    way each query computes exactly what `attend_prefill` would for it."""
    group = h_q // h_kv
    tiles = (group + _LANES - 1) // _LANES
    start = _window_start(window)
    assert d % PAGE_SIZE == 0, "head dimension must be a multiple of 16"

    @T.prim_func(s_tir=True)
    def attend_decode(var_q: T.handle, var_k_pool: T.handle, var_v_pool: T.handle, layer: T.int32,
                      var_positions: T.handle, var_page_indptr: T.handle, var_page_values: T.handle,
                      sm_scale: T.float32, var_output: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        batch, nnz = T.int32(), T.int32()
        q = T.match_buffer(var_q, (batch, h_q, d), dtype)
        k_pool, v_pool = _pools(var_k_pool, var_v_pool, h_kv, d, kv_dtype)
        positions = T.match_buffer(var_positions, (batch,), "int32")
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz,), "int32")
        output = T.match_buffer(var_output, (batch, h_q, d), dtype)
        if batch * h_kv >= _WIDE_DECODE:
            for work in T.parallel(batch * h_kv * tiles):
                with T.sblock("attend"):
                    T.reads(q[:, :, :], k_pool[layer, :, :, :, :], v_pool[layer, :, :, :, :], positions[:],
                            page_indptr[:], page_values[:])
                    T.writes(output[:, :, :])
                    b: T.let[T.int32] = work // (h_kv * tiles)
                    kv_head: T.let[T.int32] = work % (h_kv * tiles) // tiles
                    head0: T.let[T.int32] = kv_head * group + work % tiles * _LANES
                    _attend_lanes(
                        _LANES, q, d, d // 2, lambda r: b, lambda r: head0 + r,
                        T.min(_LANES, kv_head * group + group - head0), kv_head, page_indptr[b],
                        page_indptr[b + 1] - page_indptr[b], positions, start,
                        k_pool, v_pool, layer, page_values, sm_scale, output,
                    )
        else:
            for work in T.parallel(batch * h_q):
                with T.sblock("attend_narrow"):
                    T.reads(q[:, :, :], k_pool[layer, :, :, :, :], v_pool[layer, :, :, :, :], positions[:],
                            page_indptr[:], page_values[:])
                    T.writes(output[:, :, :])
                    b: T.let[T.int32] = work // h_q
                    head: T.let[T.int32] = work % h_q
                    _attend_lanes(
                        1, q, d, d // 2, lambda r: b, lambda r: head, 1, head // group, page_indptr[b],
                        page_indptr[b + 1] - page_indptr[b], positions, start,
                        k_pool, v_pool, layer, page_values, sm_scale, output,
                    )

    return attend_decode


class CPUPagedKV:
    """The KV cache as a compiled model function sees it on the CPU: the
    pools and the step's page tables (function inputs), with the methods of
    TVM's `PagedKVCache` the attention layers call.

    :param tensors: (k_pool, v_pool, positions, slots, page_indptr,
        page_values) and, for prefill, q_indptr: what
        `page_pool.PagePool.step` builds.
    :param options: the network's `kv_cache_options()`: `attn_kind` (one
        kind, or one per layer: "mha" or "mha_sliding"),
        `layer_sliding_window_size`, `rope_mode` (NONE: the model rotates)
        and `rope_scale`; the RoPE base, rotated share and Llama 3.1's
        frequency factors come from `config`.
    """

    def __init__(self, tensors, *, prefill: bool, config, options: dict, dtype: str, kv_dtype: str) -> None:
        self.k_pool, self.v_pool, self.positions, self.slots, self.page_indptr, self.page_values = tensors[:6]
        self.q_indptr = tensors[6] if prefill else None
        self.prefill = prefill
        self.config = config
        self.dtype, self.kv_dtype = dtype, kv_dtype
        kinds = options.get("attn_kind", "mha")
        self.windows = [
            options.get("layer_sliding_window_size", 0) if kind == "mha_sliding" else 0
            for kind in (kinds if isinstance(kinds, list) else [kinds] * config.num_layers)
        ]
        # RopeMode.NONE (0): the model rotates Q and K itself
        self.rotate = int(options.get("rope_mode", 1)) != 0
        self.factors = None
        if self.rotate and config.rope_freq_factors is not None:
            # the frequencies' divisors twice over, the layout the kernel reads
            self.factors = Tensor.from_const(np.asarray(list(config.rope_freq_factors) * 2, dtype=np.float32))
        self.theta = config.rope_theta
        self.scale = options.get("rope_scale", 1.0)

    def get_query_positions(self, total_length) -> Tensor:
        """Each query's position in its sequence (as TVM's cache reports them)."""
        return self.positions

    def attention_with_fused_qkv(self, layer_id: int, qkv: Tensor, num_qo_heads: int, sm_scale: float) -> Tensor:
        """Split fused (b, s, heads, d) Q/K/V, rotate Q and K, append K and V
        to the pages and attend: (b, s, query heads, d), in the activations' dtype."""
        c = self.config
        b, s, heads, d = qkv.shape
        h_kv = c.num_kv_heads
        flat = op.reshape(qkv, (b * s, heads, d))
        q, k, v = self._split_rotate(flat, num_qo_heads, h_kv, d)
        layer = tirx.IntImm("int32", layer_id)
        self.k_pool, self.v_pool = op.tensor_ir_inplace_op(
            append_kv(h_kv, d, self.dtype, self.kv_dtype), "append_kv",
            [self.k_pool, self.v_pool, k, v, self.slots, layer], [0, 1], [self.k_pool, self.v_pool],
        )
        window = self.windows[layer_id]
        out = Tensor.placeholder((b * s, num_qo_heads, d), self.dtype)
        scale = tirx.FloatImm("float32", sm_scale)
        if self.prefill:
            kernel = attend_prefill(h_kv, num_qo_heads, d, self.dtype, self.kv_dtype, window)
            args = [q, self.k_pool, self.v_pool, layer, self.q_indptr, self.positions, self.page_indptr,
                    self.page_values, scale]
        else:
            kernel = attend_decode(h_kv, num_qo_heads, d, self.dtype, self.kv_dtype, window)
            args = [q, self.k_pool, self.v_pool, layer, self.positions, self.page_indptr, self.page_values, scale]
        # a sliding-window layer's kernel is another function
        name = ("attend_prefill" if self.prefill else "attend_decode") + (f"_window{window}" if window else "")
        o = op.tensor_ir_op(kernel.with_attr("global_symbol", name), name, args, out)
        return op.reshape(o, (b, s, num_qo_heads, d))

    def _split_rotate(self, qkv: Tensor, h_q: int, h_kv: int, d: int):
        """q, k, v of fused Q/K/V, Q and K rotated at the tokens' positions
        (unless the model rotates them itself)."""
        n = qkv.shape[0]
        kernel = split_rotate_cpu(self.theta, self.scale, d, h_q, h_kv, self.dtype, self.config.rotary_dim,
                                  rotate=self.rotate, factors=self.factors is not None)
        outs = [Tensor.placeholder((n, h_q, d), self.dtype), Tensor.placeholder((n, h_kv, d), self.dtype),
                Tensor.placeholder((n, h_kv, d), self.dtype)]
        args = [qkv, self.positions] + ([self.factors] if self.factors is not None else [])
        return op.tensor_ir_op(kernel, "split_rotate", args, outs)
