"""The device sampler at run time: `DeviceSampler` loads the sampler's
library (`sampler_kernels.py`) from the compile cache, uploads each batch's
parameters and answers exactly like `lockgate.engine.sampling.sample_batch`:
`(tokens, [TokenLogprob | None])`.

Integration: `Executor.sample(logits, rows)` chooses the tokens from the
logits `prefill`/`decode` returned (the host sampler by default). With
device sampling on, the TVM executor returns a `DeviceLogits` (the logits
tensor left on the device and a host-side row index the engine's row
selection composes into) and its `sample` runs `DeviceSampler.sample_batch`
on `DeviceSampler.rows` of it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

import tvm

from lockgate.engine.sampling import SamplingRow, TokenLogprob
from lockgate.plugins.tvm.compile_cache import SAMPLER_SOURCES, cache_key, write_atomically


def compiled_sampler(vocab: int, target, cache_dir: pathlib.Path) -> pathlib.Path:
    """The sampler's library for (vocab, target) in the compile cache in
    `cache_dir`, compiled now when it is not there. Needs TVM's compiler."""
    from lockgate.plugins.tvm.sampler_build import build_sampler

    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    here = pathlib.Path(__file__).parent
    key = cache_key({"vocab": vocab, "target": str(target)}, [here / name for name in SAMPLER_SOURCES])
    library = cache_dir / f"lockgate-sampler-{key}.so"
    if not library.exists():
        write_atomically(library, build_sampler(vocab, target).export_library, ".so")
    return library


def load_sampler(vocab: int, target, cache_dir: pathlib.Path | None = None):
    """The sampler's runtime module for (vocab, target): from the compile
    cache in `cache_dir` when a library is there, else compiled now (and
    stored there when a directory is given). `target` is a TVM `Target`,
    or a kind ("llvm", "cuda"), which finds a cached library without TVM's
    compiler (`compile_cache.sampler_library`)."""
    if isinstance(target, str):
        from lockgate.plugins.tvm.compile_cache import default_cache_dir
        from lockgate.plugins.tvm.compile_cache import sampler_library

        library = sampler_library(vocab, target, cache_dir if cache_dir is not None else default_cache_dir())
        return tvm.runtime.load_module(str(library))
    if cache_dir is None:
        from lockgate.plugins.tvm.sampler_build import build_sampler

        return build_sampler(vocab, target)
    return tvm.runtime.load_module(str(compiled_sampler(vocab, target, cache_dir)))


class DeviceSampler:
    """`sample_batch` on the device: logits in, token ids and the requested
    logprobs out.

    Per call the host uploads only what the rows ask for: nothing but
    the per-row scalars (temperature, top-k, top-p, min-p, greedy flag,
    uniform) for plain requests; the sparse bias/penalty entries and the
    grammar bitmask only when some row has them; and it downloads `[batch]`
    int32 ids (plus `[batch, 20]` ids and logprobs when a row asks for
    logprobs).
    """

    def __init__(self, vocab: int, target, device, cache_dir: pathlib.Path | None = None) -> None:
        from tvm.runtime.vm import VirtualMachine

        self.vocab = int(vocab)
        self.device = device
        self._vm = VirtualMachine(load_sampler(self.vocab, target, cache_dir), device)
        self._process = self._vm["process"]
        self._greedy = self._vm["greedy"]
        self._sample = self._vm["sample"]
        self._sample_sorted = self._vm["sample_sorted"]
        self._logprobs = self._vm["logprobs"]
        self._gather = self._vm["gather"]
        self._words = (self.vocab + 31) // 32

    def _put(self, array: np.ndarray, dtype) -> object:
        return tvm.runtime.tensor(np.ascontiguousarray(array, dtype=dtype), self.device)

    def rows(self, logits, index: np.ndarray):
        """Rows `index` of the `[held, vocab]` device tensor `logits`, in
        that order: the tensor itself when `index` is all of its rows in
        order, a view of its first rows when it is a prefix (padding rows
        dropped), else gathered on the device. The result may share
        `logits`'s memory, so it is valid while `logits` is."""
        index = np.asarray(index, dtype=np.int64)
        if index.ndim != 1 or not index.size:
            raise ValueError(f"a row index is a non-empty flat sequence, got shape {index.shape}")
        held = int(logits.shape[0])
        if int(index.min()) < 0 or int(index.max()) >= held:
            raise IndexError(f"row index out of range for {held} rows")
        if (index == np.arange(index.size)).all():
            if index.size == held:
                return logits
            return logits._create_view((index.size, self.vocab))
        return self._gather(logits, self._put(index, np.int32))

    def sample_batch(self, logits, rows: Sequence[SamplingRow]) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """Like `lockgate.engine.sampling.sample_batch`; `logits` is a
        `[len(rows), vocab]` float32 tensor on this sampler's device (or a
        numpy array, uploaded first)."""
        batch = len(rows)
        if isinstance(logits, np.ndarray):
            logits = self._put(logits[:batch], np.float32)
        if tuple(logits.shape) != (batch, self.vocab):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {batch} rows of {self.vocab} tokens")
        x = self._processed(logits, rows)
        params = [r.params for r in rows]
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=batch)
        if greedy.all():
            tokens = self._greedy(x).numpy()
        else:
            # one draw per sampled row from its own generator, where the host
            # sampler draws it; greedy rows draw nothing
            uniform = np.zeros(batch, dtype=np.float64)
            for i in np.flatnonzero(~greedy):
                uniform[i] = rows[i].rng.random()
            temperature = np.fromiter(
                (1.0 if g else p.temperature for p, g in zip(params, greedy)), dtype=np.float32, count=batch
            )
            top_k = np.fromiter(
                (p.top_k if 0 < p.top_k < self.vocab else 0 for p in params), dtype=np.int32, count=batch
            )
            top_p = np.fromiter((p.top_p for p in params), dtype=np.float64, count=batch)
            min_p = np.fromiter((p.min_p for p in params), dtype=np.float64, count=batch)
            sampled = ~greedy
            common = (
                self._put(min_p, np.float64),
                self._put(greedy, np.int32),
                self._put(uniform, np.float64),
            )
            if (top_k[sampled] > 0).any() or (top_p[sampled] < 1.0).any():
                tokens = self._sample_sorted(
                    x, self._put(temperature, np.float32), self._put(top_k, np.int32),
                    self._put(top_p, np.float64), *common,
                ).numpy()
            else:
                tokens = self._sample(x, self._put(temperature, np.float32), *common).numpy()
        tokens = tokens.astype(np.int64)
        logprobs: list[TokenLogprob | None] = [None] * batch
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            chosen, ids, values = self._logprobs(logits, self._put(tokens, np.int32))
            chosen, ids, values = chosen.numpy(), ids.numpy(), values.numpy()
            for i in wanted:
                n = params[i].logprobs
                top = [(int(t), float(v)) for t, v in zip(ids[i, :n], values[i, :n])]
                logprobs[i] = TokenLogprob(token_id=int(tokens[i]), logprob=float(chosen[i]), top=top)
        return tokens, logprobs

    def _processed(self, logits, rows: Sequence[SamplingRow]):
        """The logits after grammar masks, bias and penalties (the input
        itself when no row has any)."""
        batch = len(rows)
        masked = [i for i, r in enumerate(rows) if r.allowed is not None]
        entries = _entries(rows, self.vocab)
        if not masked and entries is None:
            return logits
        bitmask = np.full((batch, self._words), -1, dtype=np.int32)
        for i in masked:
            allowed = np.zeros(self._words * 32, dtype=bool)
            allowed[: self.vocab] = np.asarray(rows[i].allowed[: self.vocab], dtype=bool)
            bitmask[i] = np.packbits(allowed, bitorder="little").view("<i4")
        if entries is None:
            entries = (np.zeros(0, np.int32),) * 2 + (np.zeros(0, np.float32),) + (np.zeros(0, np.int32),) * 2
        rows_, tokens, bias, seen, counts = entries
        rep = np.fromiter((r.params.repetition_penalty for r in rows), dtype=np.float32, count=batch)
        freq = np.fromiter((r.params.frequency_penalty for r in rows), dtype=np.float64, count=batch)
        pres = np.fromiter((r.params.presence_penalty for r in rows), dtype=np.float64, count=batch)
        return self._process(
            logits,
            self._put(bitmask, np.int32),
            self._put(rows_, np.int32),
            self._put(tokens, np.int32),
            self._put(bias, np.float32),
            self._put(seen, np.int32),
            self._put(counts, np.int32),
            self._put(rep, np.float32),
            self._put(freq, np.float64),
            self._put(pres, np.float64),
        )


def _entries(rows: Sequence[SamplingRow], vocab: int):
    """The sparse adjustments as arrays (row, token, bias, seen, count), one
    entry per distinct (row, token); None when no row has any. `seen` marks
    the tokens the repetition penalty applies to (prompt and output, when
    it is not 1), `count` the output occurrences the presence and frequency
    penalties scale with (when either is set), as the host applies them."""
    out_rows: list[np.ndarray] = []
    out_tokens: list[np.ndarray] = []
    out_bias: list[np.ndarray] = []
    out_seen: list[np.ndarray] = []
    out_counts: list[np.ndarray] = []
    for i, row in enumerate(rows):
        p = row.params
        bias: dict[int, float] = dict(p.logit_bias) if p.logit_bias else {}
        seen = (
            np.unique(np.asarray([*row.prompt_ids, *row.output_ids], dtype=np.int64))
            if p.repetition_penalty != 1.0
            else np.zeros(0, np.int64)
        )
        if len(row.output_ids) and (p.presence_penalty or p.frequency_penalty):
            counted, counts = np.unique(np.asarray(row.output_ids, dtype=np.int64), return_counts=True)
        else:
            counted, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
        bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        tokens = np.union1d(np.union1d(bias_ids, seen), counted)
        if not tokens.size:
            continue
        bias_values = np.zeros(tokens.size, np.float32)
        bias_values[np.searchsorted(tokens, bias_ids)] = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        seen_flags = np.zeros(tokens.size, np.int32)
        seen_flags[np.searchsorted(tokens, seen)] = 1
        token_counts = np.zeros(tokens.size, np.int32)
        token_counts[np.searchsorted(tokens, counted)] = counts
        out_rows.append(np.full(tokens.size, i, np.int32))
        out_tokens.append(tokens.astype(np.int32))
        out_bias.append(bias_values)
        out_seen.append(seen_flags)
        out_counts.append(token_counts)
    if not out_rows:
        return None
    return tuple(np.concatenate(a) for a in (out_rows, out_tokens, out_bias, out_seen, out_counts))
