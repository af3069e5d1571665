"""The sampler's kernels: the host sampler's choices as TVM functions, so
that sampling runs where the logits are and only token ids (and the
logprobs asked for) cross to the host. `sampler.py` runs them.

`sampler_module` is a small relax module of its own (apart from the
model's, so neither compile disturbs the other), which `sampler_build`
schedules and compiles for `llvm` or `cuda`;
`DeviceSampler` runs it on `[batch, vocab]` logits already on the device
plus per-row parameter arrays, and answers exactly like
`lockgate.engine.sampling.sample_batch`: `(tokens, [TokenLogprob | None])`.

The functions in the library, all over a symbolic batch and the static
vocabulary `V`:

* `process(logits, bitmask, rows, tokens, bias, seen, counts, rep, freq,
  pres)` → the logits the choice is made from: grammar masks uploaded as
  bits (`[batch, ceil(V/32)]` int32, bit `t % 32` of word `t // 32`; a
  cleared bit is `-inf`), then the sparse per-(row, token) entries of
  `logit_bias`, the repetition penalty and the presence/frequency
  penalties, one entry per distinct (row, token) and in the host's order:
  bias added in float32, repetition divided/multiplied in float32,
  `frequency * count + presence` subtracted in float64 and rounded to
  float32, as numpy does on the host.
* `greedy(x)` → first index of the row's maximum (numpy's `argmax`).
* `sample(x, temperature, min_p, greedy, uniform)` and
  `sample_sorted(x, temperature, top_k, top_p, min_p, greedy, uniform)` →
  one token per row; the second sorts each row and is only called when a
  row of the batch asks for top-k or top-p.
* `logprobs(logits, tokens)` → the chosen tokens' log-probabilities and the
  `MAX_TOP_LOGPROBS` best tokens with theirs, under the model's own
  distribution (the raw logits), as OpenAI reports them.
* `gather(logits, index)` → rows `index` of `[held, V]` logits, in that
  order (repeats allowed): the rows the engine samples, taken out of what
  the forward pass left on the device (`DeviceSampler.rows`).

How a token is chosen (the choice the host's `_draw` makes, step by step;
the same uniform gives the same token but at rounding boundaries, below):

1. `y = x / temperature` in float32;
2. top-k keeps `y >= kth`, `kth` the k-th largest of the sorted row (ties at
   the k-th value are kept, as `np.partition` + `<` keeps them);
3. `e = exp(float64(y - max(y)))`, `p = e / sum(e)`; min-p zeroes
   `p < min_p * (1 / sum(e))` (the largest `p` is `exp(0) / sum`);
4. top-p: the host sorts `p` descending (stably) and keeps the shortest
   prefix whose cumulative mass reaches `top_p` of the whole. The sorted
   values need no stable sort: they are `g(sorted(y))` for the monotone map
   `g` of steps 2–3, so the device sorts `y` once, cumulates `g` of it, and
   takes the cut value `v` and how many tokens equal to `v` the host's
   stable order keeps (`r`); in vocabulary order it then keeps `p > v`, and
   the first `r` tokens with `p == v` (a cumulative count of them);
5. the draw: the first token whose cumulative kept mass (vocabulary order)
   exceeds `u * total`, `u` the row's uniform, drawn on the host from the
   request's own generator exactly where the host sampler draws it (one
   `rng.random()` per non-greedy row, none for greedy rows), so a seeded
   request gives the same tokens whatever shares its batch.

The device computes the probabilities in float64. The host computes the
same choice in float32 (exp of `x / temperature`, sums per block of 256
tokens, the block drawn and then the token inside it, and only candidates
exponentiated for top-k and min-p rows; see `lockgate.engine.sampling`),
so the two can disagree only when the uniform lands within float32
rounding (about 1e-7 of the mass) of a boundary between two tokens'
cumulative masses, or a top-p or min-p cut falls that close to a token's
probability. On flat random 49,152-token rows that is about one plain
sampled row in a thousand (none seen for top-k or min-p rows); the tests'
seeded draws agree token for token.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

#: the most alternatives one token's logprobs may list (OpenAI's limit)
MAX_TOP_LOGPROBS = 20

#: threads per block for the GPU kernels written here
GPU_THREADS = 256


def _neg_inf(dtype: str = "float32"):
    return tirx.const(float("-inf"), dtype)


def _row_max(x: te.Tensor, name: str) -> te.Tensor:
    batch, vocab = x.shape
    j = te.reduce_axis((0, vocab), name="j")
    return te.compute((batch,), lambda i: te.max(x[i, j], axis=j), name=name)


def _first_index(vocab: int, pred, batch, name: str) -> te.Tensor:
    """Per row, the least j with pred(i, j), else 0 (numpy's argmax of a
    boolean row)."""
    j = te.reduce_axis((0, vocab), name="j")
    first = te.compute(
        (batch,),
        lambda i: te.min(tirx.Select(pred(i, j), j.var.astype("int64"), tirx.const(vocab, "int64")), axis=j),
        name=name + "_min",
    )
    return te.compute(
        (batch,),
        lambda i: tirx.Select(first[i] == vocab, tirx.const(0, "int32"), first[i].astype("int32")),
        name=name,
    )


def _argmax_te(x: te.Tensor, m: te.Tensor) -> te.Tensor:
    """The first index of each row's maximum `m` (numpy's argmax)."""
    batch, vocab = x.shape
    return _first_index(int(vocab), lambda i, j: x[i, j] == m[i], batch, "argmax")


def _emit_greedy(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Var:
    m = bb.emit_te(_row_max, x, "greedy_max", primfunc_name_hint="greedy_max")
    return bb.emit_te(_argmax_te, x, m, primfunc_name_hint="argmax")


def _mask_te(logits: te.Tensor, bitmask: te.Tensor) -> te.Tensor:
    def body(i, j):
        word = bitmask[i, j // 32]
        bit = tirx.bitwise_and(tirx.shift_right(word, (j % 32).astype("int32")), tirx.const(1, "int32"))
        return tirx.Select(bit == 1, logits[i, j], _neg_inf())

    return te.compute(logits.shape, body, name="masked")


def _entries_func(gpu: bool) -> tirx.PrimFunc:
    """The sparse (row, token) adjustments, in place on x: one thread per
    entry on a GPU (entries are distinct, so no two write one element)."""
    from tvm.script import tirx as T

    threads = GPU_THREADS if gpu else 1

    @T.macro
    def one_entry(x, rows, tokens, bias, seen, counts, rep, freq, pres, k):
        row = rows[k]
        token = tokens[k]
        biased = x[row, token] + bias[k]
        penalized = T.Select(
            seen[k] != 0,
            T.Select(biased > T.float32(0), biased / rep[row], biased * rep[row]),
            biased,
        )
        x[row, token] = T.Select(
            counts[k] != 0,
            T.Cast(
                "float32",
                T.Cast("float64", penalized) - (freq[row] * T.Cast("float64", counts[k]) + pres[row]),
            ),
            penalized,
        )

    @T.prim_func(private=True, s_tir=True)
    def apply_entries(
        var_x: T.handle,
        var_rows: T.handle,
        var_tokens: T.handle,
        var_bias: T.handle,
        var_seen: T.handle,
        var_counts: T.handle,
        var_rep: T.handle,
        var_freq: T.handle,
        var_pres: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, vocab, n = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(var_x, (batch, vocab), "float32")
        rows = T.match_buffer(var_rows, (n,), "int32")
        tokens = T.match_buffer(var_tokens, (n,), "int32")
        bias = T.match_buffer(var_bias, (n,), "float32")
        seen = T.match_buffer(var_seen, (n,), "int32")
        counts = T.match_buffer(var_counts, (n,), "int32")
        rep = T.match_buffer(var_rep, (batch,), "float32")
        freq = T.match_buffer(var_freq, (batch,), "float64")
        pres = T.match_buffer(var_pres, (batch,), "float64")
        if gpu:
            for bx in T.thread_binding((n + threads - 1) // threads, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    if bx * threads + tx < n:
                        one_entry(x, rows, tokens, bias, seen, counts, rep, freq, pres, bx * threads + tx)
        else:
            for k in range(n):
                one_entry(x, rows, tokens, bias, seen, counts, rep, freq, pres, k)

    return apply_entries


def _scaled_te(x: te.Tensor, temperature: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda i, j: x[i, j] / temperature[i], name="scaled")


def _exp_shifted(yv, m, kth=None):
    """exp(float64(y - max)) in float64, zero below the top-k threshold."""
    e = tirx.exp((yv - m).astype("float64"))
    if kth is None:
        return e
    return tirx.Select(yv >= kth, e, tirx.const(0.0, "float64"))


def _mass_te(y: te.Tensor, m: te.Tensor, kth: te.Tensor | None) -> te.Tensor:
    batch, vocab = y.shape
    j = te.reduce_axis((0, vocab), name="j")
    return te.compute(
        (batch,),
        lambda i: te.sum(_exp_shifted(y[i, j], m[i], None if kth is None else kth[i]), axis=j),
        name="mass",
    )


def _probs_te(y, m, kth, total, min_p, name) -> te.Tensor:
    """p = e / sum, zeroed below min_p * max(p)."""

    def body(i, j):
        p = _exp_shifted(y[i, j], m[i], None if kth is None else kth[i]) / total[i]
        floor = min_p[i] * (tirx.const(1.0, "float64") / total[i])
        return tirx.Select(p < floor, tirx.const(0.0, "float64"), p)

    return te.compute(y.shape, body, name=name)


def _kth_te(sorted_y: te.Tensor, top_k: te.Tensor) -> te.Tensor:
    batch, vocab = sorted_y.shape

    def body(i):
        k = top_k[i]
        use = tirx.all(k > 0, k < int(vocab))
        idx = tirx.Select(use, k - 1, 0).astype("int64")
        return tirx.Select(use, sorted_y[i, idx], _neg_inf())

    return te.compute((batch,), body, name="kth")


def _keep_count_te(cum: te.Tensor, top_p: te.Tensor) -> te.Tensor:
    """How many of the sorted probabilities the host's top-p keeps:
    searchsorted(cum, top_p * cum[-1]) + 1."""
    batch, vocab = cum.shape
    j = te.reduce_axis((0, vocab), name="j")
    below = te.compute(
        (batch,),
        lambda i: te.sum(
            tirx.Select(cum[i, j] < top_p[i] * cum[i, int(vocab) - 1], 1, 0).astype("int32"), axis=j
        ),
        name="below",
    )
    return te.compute((batch,), lambda i: below[i] + 1, name="keep")


def _cut_value_te(sorted_p: te.Tensor, keep: te.Tensor, top_p: te.Tensor) -> te.Tensor:
    """The smallest kept probability; -1 (keep all) where top_p is off."""
    batch, _ = sorted_p.shape
    return te.compute(
        (batch,),
        lambda i: tirx.Select(
            top_p[i] < 1.0, sorted_p[i, (keep[i] - 1).astype("int64")], tirx.const(-1.0, "float64")
        ),
        name="cut",
    )


def _ties_kept_te(sorted_p: te.Tensor, cut: te.Tensor, keep: te.Tensor) -> te.Tensor:
    """How many tokens equal to the cut value the host keeps (the first of
    them in vocabulary order: its argsort is stable)."""
    batch, vocab = sorted_p.shape
    j = te.reduce_axis((0, vocab), name="j")
    above = te.compute(
        (batch,),
        lambda i: te.sum(tirx.Select(sorted_p[i, j] > cut[i], 1, 0).astype("int32"), axis=j),
        name="above",
    )
    return te.compute((batch,), lambda i: keep[i] - above[i], name="ties_kept")


def _is_cut_te(p: te.Tensor, cut: te.Tensor) -> te.Tensor:
    return te.compute(
        p.shape, lambda i, j: tirx.Select(p[i, j] == cut[i], 1, 0).astype("int32"), name="is_cut"
    )


def _kept_te(p: te.Tensor, cut: te.Tensor, rank: te.Tensor, ties: te.Tensor) -> te.Tensor:
    def body(i, j):
        keep = tirx.any(p[i, j] > cut[i], tirx.all(p[i, j] == cut[i], rank[i, j] <= ties[i]))
        return tirx.Select(keep, p[i, j], tirx.const(0.0, "float64"))

    return te.compute(p.shape, body, name="kept")


def _draw_te(cum: te.Tensor, uniform: te.Tensor) -> te.Tensor:
    batch, vocab = cum.shape
    last = int(vocab) - 1
    return _first_index(int(vocab), lambda i, j: cum[i, j] > uniform[i] * cum[i, last], batch, "drawn")


def _choose_te(is_greedy: te.Tensor, greedy: te.Tensor, drawn: te.Tensor) -> te.Tensor:
    return te.compute(
        greedy.shape, lambda i: tirx.Select(is_greedy[i] != 0, greedy[i], drawn[i]), name="tokens"
    )


def _lse_te(logits: te.Tensor, m: te.Tensor) -> te.Tensor:
    batch, vocab = logits.shape
    j = te.reduce_axis((0, vocab), name="j")
    total = te.compute((batch,), lambda i: te.sum(tirx.exp(logits[i, j] - m[i]), axis=j), name="sumexp")
    return te.compute((batch,), lambda i: tirx.log(total[i]), name="lse")


def _token_logprob_te(logits, m, lse, tokens) -> te.Tensor:
    return te.compute(
        m.shape, lambda i: (logits[i, tokens[i].astype("int64")] - m[i]) - lse[i], name="token_logprob"
    )


def _best_te(order: te.Tensor, n: int) -> te.Tensor:
    return te.compute((order.shape[0], n), lambda i, j: order[i, j], name="best")


def _top_logprob_te(logits, ids, m, lse) -> te.Tensor:
    return te.compute(
        ids.shape,
        lambda i, j: (logits[i, ids[i, j].astype("int64")] - m[i]) - lse[i],
        name="top_logprob",
    )


# ------------------------------------------------------------------ module


def sampler_module(vocab: int, gpu: bool) -> tvm.IRModule:
    """The sampler's relax functions for a vocabulary of `vocab` tokens."""
    batch = tirx.Var("batch", "int64")
    n = tirx.Var("n", "int64")
    words = (vocab + 31) // 32

    def tensor(name, shape, dtype):
        return relax.Var(name, relax.TensorType(shape, dtype))

    bb = relax.BlockBuilder()

    logits = tensor("logits", (batch, vocab), "float32")
    bitmask = tensor("bitmask", (batch, words), "int32")
    rows = tensor("rows", (n,), "int32")
    tokens = tensor("tokens", (n,), "int32")
    bias = tensor("bias", (n,), "float32")
    seen = tensor("seen", (n,), "int32")
    counts = tensor("counts", (n,), "int32")
    rep = tensor("rep", (batch,), "float32")
    freq = tensor("freq", (batch,), "float64")
    pres = tensor("pres", (batch,), "float64")
    with bb.function("process", [logits, bitmask, rows, tokens, bias, seen, counts, rep, freq, pres]):
        with bb.dataflow():
            x = bb.emit_te(_mask_te, logits, bitmask, primfunc_name_hint="mask")
            entries = bb.add_func(_entries_func(gpu), "apply_entries")
            x = bb.emit(
                relax.call_tir_inplace(
                    entries,
                    [x, rows, tokens, bias, seen, counts, rep, freq, pres],
                    inplace_indices=[0],
                    out_ty=relax.TensorType((batch, vocab), "float32"),
                )
            )
            out = bb.emit_output(x)
        bb.emit_func_output(out)

    x = tensor("x", (batch, vocab), "float32")
    with bb.function("greedy", [x]):
        with bb.dataflow():
            out = bb.emit_output(_emit_greedy(bb, x))
        bb.emit_func_output(out)

    for sorted_variant in (False, True):
        x = tensor("x", (batch, vocab), "float32")
        temperature = tensor("temperature", (batch,), "float32")
        top_k = tensor("top_k", (batch,), "int32")
        top_p = tensor("top_p", (batch,), "float64")
        min_p = tensor("min_p", (batch,), "float64")
        is_greedy = tensor("is_greedy", (batch,), "int32")
        uniform = tensor("uniform", (batch,), "float64")
        params = [x, temperature, *([top_k, top_p] if sorted_variant else []), min_p, is_greedy, uniform]
        with bb.function("sample_sorted" if sorted_variant else "sample", params):
            with bb.dataflow():
                greedy = _emit_greedy(bb, x)
                y = bb.emit_te(_scaled_te, x, temperature, primfunc_name_hint="scaled")
                m = bb.emit_te(_row_max, y, "row_max", primfunc_name_hint="row_max")
                if sorted_variant:
                    sorted_y = bb.emit(relax.op.sort(y, axis=1, descending=True))
                    kth = bb.emit_te(_kth_te, sorted_y, top_k, primfunc_name_hint="kth")
                    total = bb.emit_te(_mass_te, y, m, kth, primfunc_name_hint="mass")
                    sorted_p = bb.emit_te(
                        _probs_te, sorted_y, m, kth, total, min_p, "sorted_probs", primfunc_name_hint="sorted_probs"
                    )
                    sorted_cum = bb.emit(relax.op.cumsum(sorted_p, axis=1))
                    keep = bb.emit_te(_keep_count_te, sorted_cum, top_p, primfunc_name_hint="keep")
                    cut = bb.emit_te(_cut_value_te, sorted_p, keep, top_p, primfunc_name_hint="cut")
                    ties = bb.emit_te(_ties_kept_te, sorted_p, cut, keep, primfunc_name_hint="ties_kept")
                    p = bb.emit_te(_probs_te, y, m, kth, total, min_p, "probs", primfunc_name_hint="probs")
                    is_cut = bb.emit_te(_is_cut_te, p, cut, primfunc_name_hint="is_cut")
                    rank = bb.emit(relax.op.cumsum(is_cut, axis=1, dtype="int32"))
                    p = bb.emit_te(_kept_te, p, cut, rank, ties, primfunc_name_hint="kept")
                else:
                    total = bb.emit_te(_mass_te, y, m, None, primfunc_name_hint="mass")
                    p = bb.emit_te(_probs_te, y, m, None, total, min_p, "probs", primfunc_name_hint="probs")
                cum = bb.emit(relax.op.cumsum(p, axis=1))
                drawn = bb.emit_te(_draw_te, cum, uniform, primfunc_name_hint="draw")
                out = bb.emit_output(
                    bb.emit_te(_choose_te, is_greedy, greedy, drawn, primfunc_name_hint="choose")
                )
            bb.emit_func_output(out)

    # the rows the engine samples from, in its order (repeats allowed: the
    # choices of one request share its prompt's row), gathered on the device;
    # "clip" because TVM's default "fast" reads out of bounds on a bad index
    # (and warns so at every build); the host checks the index anyway
    held = tirx.Var("held", "int64")
    logits = tensor("logits", (held, vocab), "float32")
    index = tensor("index", (batch,), "int32")
    with bb.function("gather", [logits, index]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.take(logits, index, axis=0, mode="clip")))
        bb.emit_func_output(out)

    logits = tensor("logits", (batch, vocab), "float32")
    chosen = tensor("chosen", (batch,), "int32")
    with bb.function("logprobs", [logits, chosen]):
        with bb.dataflow():
            m = bb.emit_te(_row_max, logits, "logit_max", primfunc_name_hint="logit_max")
            lse = bb.emit_te(_lse_te, logits, m, primfunc_name_hint="lse")
            token_lp = bb.emit_te(_token_logprob_te, logits, m, lse, chosen, primfunc_name_hint="token_logprob")
            # argsort and a gather rather than topk: TVM's GPU topk is the
            # same sort followed by a slice it leaves to dl.gpu.Fallback
            order = bb.emit(relax.op.argsort(logits, axis=1, descending=True, dtype="int32"))
            ids = bb.emit_te(_best_te, order, min(MAX_TOP_LOGPROBS, vocab), primfunc_name_hint="best")
            top_lp = bb.emit_te(_top_logprob_te, logits, ids, m, lse, primfunc_name_hint="top_logprob")
            out = bb.emit_output(relax.Tuple([token_lp, ids, top_lp]))
        bb.emit_func_output(out)

    return bb.get()
