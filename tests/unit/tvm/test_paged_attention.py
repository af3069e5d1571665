"""The CPU KV cache's kernels (`paged_attention.py`) and its pages
(`page_pool.py`): appended keys land where the page tables say, attention
matches float64 over pages listed in any order (causal and windowed), and
a query's result is the same bits whichever kernel, tile, chunk or batch
computes it."""

from __future__ import annotations

import math

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from lockgate.plugins.tvm import paged_attention as pa  # noqa: E402
from lockgate.plugins.tvm.page_pool import PagePool  # noqa: E402

TARGET = tvm.target.Target.from_device(tvm.cpu())
PAGE = pa.PAGE_SIZE


def _tensor(array):
    return tvm.runtime.tensor(np.ascontiguousarray(array), tvm.cpu())


def _compile(func, name):
    return tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=TARGET)


class Cache:
    """Pools of `pages` pages for one layer, a `PagePool` over them, and the
    kernels compiled for (h_kv, h_q, d)."""

    def __init__(self, h_kv=2, h_q=6, d=32, pages=24, window=0, layers=2):
        self.h_kv, self.h_q, self.d, self.layers = h_kv, h_q, d, layers
        self.k = np.zeros((layers, pages, h_kv, d, PAGE), np.float16)
        self.v = np.zeros((layers, pages, h_kv, PAGE, d), np.float16)

        def copy(src, dst):
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

        self.pool = PagePool(pages, copy)
        self.append = _compile(pa.append_kv(h_kv, d, "float32", "float16"), "append")["append"]
        self.prefill = _compile(pa.attend_prefill(h_kv, h_q, d, "float32", "float16", window), "p")["p"]
        self.decode = _compile(pa.attend_decode(h_kv, h_q, d, "float32", "float16", window), "d")["d"]
        self.keys: dict[int, list] = {}

    def run(self, seq_ids, qs, ks, vs, layer=1, decode=False):
        """Append `ks[i]`, `vs[i]` ((n_i, h_kv, d)) to sequence i and attend
        with `qs[i]`; the output rows in order."""
        lengths = [len(q) for q in qs]
        step = self.pool.step(seq_ids, lengths)
        k, v = _tensor(self.k), _tensor(self.v)
        self.append(k, v, _tensor(np.concatenate(ks)), _tensor(np.concatenate(vs)), _tensor(step.slots), layer)
        self.k[:], self.v[:] = k.numpy(), v.numpy()
        q = np.concatenate(qs)
        out = _tensor(np.zeros((len(q), self.h_q, self.d), np.float32))
        scale = 1 / math.sqrt(self.d)
        tables = (_tensor(step.positions), _tensor(step.page_indptr), _tensor(step.page_values))
        if decode:
            self.decode(_tensor(q), k, v, layer, *tables, scale, out)
        else:
            self.prefill(_tensor(q), k, v, layer, _tensor(step.q_indptr), *tables, scale, out)
        for seq_id, kk, vv in zip(seq_ids, ks, vs):
            self.keys.setdefault(seq_id, []).extend(zip(kk, vv))
        return out.numpy(), step


def _qkv(rng, n, h_q, h_kv, d):
    return (rng.standard_normal((n, h_q, d)).astype(np.float32),
            rng.standard_normal((n, h_kv, d)).astype(np.float32),
            rng.standard_normal((n, h_kv, d)).astype(np.float32))


def _reference(q, kv, positions, window, scale, group):
    out = np.zeros(q.shape)
    for row, p in enumerate(positions):
        first = max(p + 1 - window, 0) if window else 0
        keys = np.stack([k.astype(np.float16).astype(np.float64) for k, _ in kv[first:p + 1]])
        values = np.stack([v.astype(np.float16).astype(np.float64) for _, v in kv[first:p + 1]])
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[row, h].astype(np.float64) * scale
            w = np.exp(scores - scores.max())
            out[row, h] = w @ values[:, h // group] / w.sum()
    return out


@pytest.mark.parametrize("window", [0, 20])
def test_prefill_attention_against_float64(window):
    """Sequences that fill a tile and a page, miss them by one, or are a
    single token, chunked and batched; pages taken out of order (a freed
    page reused)."""
    cache = Cache(window=window)
    rng = np.random.default_rng(3)
    cache.pool.add(99)
    cache.run([99], *map(lambda a: [a], _qkv(rng, 40, 6, 2, 32)))
    for seq in (1, 2, 3):
        cache.pool.add(seq)
    cache.pool.remove(99)  # its pages come back in another order
    chunks = [[5, 16, 1], [17, 3, 20], [1, 40, 2]]
    for seq_lengths in zip(*chunks):
        qs, ks, vs = zip(*(_qkv(rng, n, 6, 2, 32) for n in seq_lengths))
        out, step = cache.run([1, 2, 3], list(qs), list(ks), list(vs))
        for i, seq in enumerate((1, 2, 3)):
            rows = slice(step.q_indptr[i], step.q_indptr[i + 1])
            want = _reference(qs[i], cache.keys[seq], step.positions[rows], window, 1 / math.sqrt(32), 3)
            np.testing.assert_allclose(out[rows], want, atol=2e-3)


def test_a_query_is_the_same_bits_in_decode_and_in_any_prefill():
    """The last token of a 37-token sequence: prefilled whole, in chunks of
    any split, batched with others, from a forked prefix, or decoded."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 37, 6, 2, 32)
    cache = Cache(pages=64)
    results = []

    def fresh(seq_id):
        cache.pool.add(seq_id)
        return seq_id

    out, _ = cache.run([fresh(1)], [q], [k], [v])
    results.append(out[-1])
    for split in (1, 15, 16, 17, 33, 36):
        seq = fresh(10 + split)
        cache.run([seq], [q[:split]], [k[:split]], [v[:split]])
        out, _ = cache.run([seq], [q[split:]], [k[split:]], [v[split:]])
        results.append(out[-1])
    seq = fresh(2)
    cache.run([seq], [q[:36]], [k[:36]], [v[:36]])
    out, _ = cache.run([seq], [q[36:]], [k[36:]], [v[36:]], decode=True)
    results.append(out[0])
    # batched with another sequence, prefill and decode
    other = fresh(3)
    cache.run([other], *map(lambda a: [a], _qkv(rng, 20, 6, 2, 32)))
    seq = fresh(4)
    cache.run([seq], [q[:36]], [k[:36]], [v[:36]])
    extra = _qkv(rng, 1, 6, 2, 32)
    out, _ = cache.run([other, seq], [extra[0], q[36:]], [extra[1], k[36:]], [extra[2], v[36:]], decode=True)
    results.append(out[1])
    # a batch wide enough that a group's heads share each load (four sequences of two KV heads)
    others = [fresh(seq) for seq in (5, 6, 7)]
    for seq in others:
        cache.run([seq], *map(lambda a: [a], _qkv(rng, 9, 6, 2, 32)))
    seq = fresh(8)
    cache.run([seq], [q[:36]], [k[:36]], [v[:36]])
    extra = [_qkv(rng, 1, 6, 2, 32) for _ in others]
    out, _ = cache.run([*others, seq], [e[0] for e in extra] + [q[36:]], [e[1] for e in extra] + [k[36:]],
                       [e[2] for e in extra] + [v[36:]], decode=True)
    results.append(out[3])
    # forked from a sequence holding the prefix (mid-page and on a page boundary)
    for at in (36, 32):
        child = 100 + at
        cache.pool.fork(1, child, at)
        out, _ = cache.run([child], [q[at:]], [k[at:]], [v[at:]], decode=at == 36)
        results.append(out[-1])
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


def test_page_pool_shares_copies_and_returns_pages():
    copies = []
    pool = PagePool(8, lambda src, dst: copies.append((src, dst)))
    pool.add(1)
    step = pool.step([1], [20])
    assert pool.free_pages() == 6 and list(step.positions) == list(range(20))
    assert list(step.slots[:2]) == [0, 1] and step.slots[16] == step.page_values[1] * PAGE
    pool.fork(1, 2, 20)  # shares page 0, copies the part-filled page 1
    assert copies == [(int(step.page_values[1]), int(copies[0][1]))] and pool.free_pages() == 5
    pool.fork(1, 3, 16)  # on a page boundary: shares, copies nothing
    assert len(copies) == 1 and pool.free_pages() == 5
    pool.truncate(1, 5)  # into the shared page 0: page 1 goes back, page 0 is copied
    assert pool.free_pages() == 5 and pool.length(1) == 5 and len(copies) == 2
    pool.step([1], [1])  # writes to its own copy
    assert len(copies) == 2 and pool.free_pages() == 5
    for seq in (1, 2, 3):
        pool.remove(seq)
    assert pool.free_pages() == 8


@pytest.mark.parametrize("call, says", [
    (lambda p: p.add(1), "already exists"),
    (lambda p: p.remove(5), "unknown sequence"),
    (lambda p: p.fork(1, 2, 0), "cannot fork"),
    (lambda p: p.fork(1, 2, 11), "cannot fork"),
    (lambda p: p.truncate(1, 11), "cannot truncate"),
    (lambda p: p.step([1], [100]), "KV pages needed"),
])
def test_page_pool_refuses_before_it_changes_anything(call, says):
    pool = PagePool(4, lambda src, dst: None)
    pool.add(1)
    pool.step([1], [10])
    with pytest.raises(ValueError, match=says):
        call(pool)
    assert pool.free_pages() == 3 and pool.length(1) == 10


def test_exp2_approx_is_float32_accurate():
    from tvm import te

    x = np.concatenate([np.linspace(-130, 130, 20001), [-126.0, -125.9, 0.0, 126.0, 127.5]]).astype(np.float32)
    inp = te.placeholder(x.shape, "float32", name="x")
    out = te.compute(inp.shape, lambda i: pa.exp2_approx(inp[i]), name="y")
    lib = tvm.compile(te.create_prim_func([inp, out]), target=TARGET)
    got = _tensor(np.zeros_like(x))
    lib(_tensor(x), got)
    got = got.numpy().astype(np.float64)
    want = np.exp2(np.clip(x.astype(np.float64), None, 126.0))
    inside = (x > -126) & (x <= 126)
    np.testing.assert_allclose(got[inside], want[inside], rtol=2.5e-7)
    assert (got[x <= -126] == 0).all() and (got[x > 126] == 2.0**126).all()
