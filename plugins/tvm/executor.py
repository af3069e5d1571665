"""The TVM executor: a model family's compiled network over TVM's paged KV cache."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import structlog

from lockgate.errors import ModelLoadError
from lockgate.memory import Trimmer
from lockgate.engine.executor import Executor, ExecutorOptions
from lockgate.models.model_file import ModelFile
from lockgate.plugins.tvm import runtime
from lockgate.plugins.tvm.call_checks import PAD_ID_BASE as _PAD_ID_BASE, CallerChecks
from lockgate.plugins.tvm.device_logits import DeviceLogits, View
from lockgate.plugins.tvm.kv import CPUCache, TVMCache, kv_cache_bytes
from lockgate.plugins.tvm.settings import TVMOptions
from lockgate.plugins.tvm.weight_streaming import Uploads

log = structlog.get_logger("lockgate.executor")

#: decode batch sizes on CUDA: a batch is padded up to the next of these, so
#: `batch_decode` is captured as a CUDA graph once per bucket, not once per
#: batch size; batches above the last run through `batch_prefill`, whose
#: `dl.gpu.Matmul` kernels beat `LowBatchGEMV` there (and a step that long is
#: not bound by kernel launches)
DECODE_BUCKETS = (2, 4, 8, 16, 24, 32)

#: a prefill of at least this many tokens is followed by a trim of the C
#: allocator (at most one a second, off the engine's thread): its
#: activations, freed by the VM's plain CPU allocator, otherwise stay
#: resident in glibc's arenas
LARGE_PREFILL_TOKENS = 128


class TVMExecutor(CallerChecks, Executor):
    """Runs `embed`, `batch_prefill`, `batch_prefill_hidden` and
    `batch_decode` of a compiled model.

    Sequence lengths are mirrored on the Python side so that caller mistakes
    (unknown ids, over-long sequences, oversized chunks) are refused with
    `ValueError` before the KV cache is touched.
    """

    def __init__(self, model_file: ModelFile, options: ExecutorOptions) -> None:
        for name in ("max_num_seqs", "max_total_tokens", "prefill_chunk_size"):
            if getattr(options, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(options, name)}")
        tvm_options = TVMOptions.of(options)
        runtime.set_num_threads(tvm_options.num_threads)

        from lockgate.plugins.tvm import weights
        from lockgate.plugins.tvm.compile_cache import model_library, target_kind
        from lockgate.plugins.tvm.formats import CPU_ACTIVATIONS
        from lockgate.plugins.tvm.weights import (
            QuantizedAtLoad,
            describe_load_report,
            iter_gguf_weights,
            linear_formats,
            load_report,
        )

        self._progress = options.progress or (lambda _msg: None)
        config = model_file.config
        self.config = config
        # the runtime alone answers this and finds a cached library: TVM's
        # compiler is loaded only to build one (`compile_cache`)
        kind = target_kind(tvm_options.target)
        tensors = weights.open_tensors(model_file)
        family = model_file.family
        if family is None:
            from lockgate.plugins.tvm import builtin_families

            family = builtin_families().for_architecture(config.architecture)
        self.family = family
        # a directory's rows are in Hugging Face's order already
        permuted_qk = family.permuted_qk and not os.path.isdir(model_file.path)
        if tvm_options.quantize:
            tensors = QuantizedAtLoad(tensors, tvm_options.quantize, config)
        formats = linear_formats(tensors, config)
        self.load_report = load_report(tensors, config, formats)
        log.info("weight formats", formats=describe_load_report(self.load_report))
        if self.load_report["widened"]:
            widened = self.load_report["widened"]
            extra = sum(row["bytes"] - row["file_bytes"] for row in widened)
            log.warning(
                "weights widened to f16: no kernel reads their type",
                tensors=", ".join(f"{row['tensor']} ({row['type']})" for row in widened),
                extra_mib=round(extra / (1 << 20), 1),
            )
        cuda = kind == "cuda"
        if tvm_options.exact_matmul and not cuda:
            formats[CPU_ACTIVATIONS] = "float32"
        self.compiled, facts = model_library(
            config,
            kind,
            tvm_options.cache_dir,
            options.progress,
            formats,
            options.max_num_seqs if cuda else None,
            family.networks.get("tvm") or family.network("tvm"),
        )
        self.device = runtime.device("cuda" if cuda else "cpu")
        page_size = facts["page_size"]
        pages = math.ceil(options.max_total_tokens / page_size)
        buckets = DECODE_BUCKETS if cuda else ()
        self._set_decode_buckets(buckets)
        # what the uploads below allocate: every parameter the library takes, norms included
        weight_bytes = sum(math.prod(shape) * np.dtype(self.compiled.dtypes[name]).itemsize
                           for name, shape in self.compiled.params)
        self.memory = {"weights": weight_bytes,
                       "kv_cache": kv_cache_bytes(config, pages + (self._max_pad if cuda else 0), page_size)}
        if options.reserve is not None:
            options.reserve(dict(self.memory))

        self._progress("loading weights…")
        uploads = Uploads(self.device)
        try:
            self._params = [
                uploads.tensor(array)
                for array in iter_gguf_weights(
                    tensors,
                    config,
                    self.compiled.params,
                    options.progress,
                    self.compiled.formats,
                    gpu=cuda,
                    permuted_qk=permuted_qk,
                    contiguous=False,
                    allocate=uploads.allocate,
                )
            ]
        except OSError as exc:
            raise ModelLoadError(f"cannot read GGUF file {model_file.path}: {exc}") from exc
        del tensors  # unmaps the file
        weights.release_loading_memory()

        # On the CPU the VM's default pooled allocator keeps a buffer for every
        # shape it has seen (each batch size and prefill length): under varied
        # load that held ~230 MiB more than the plain allocator, which measured
        # no slower here. GPU allocations are costly, so CUDA keeps the pool.
        self._vm = runtime.load_vm(str(self.compiled.library), self.device, "pooled" if cuda else "naive")
        self._embed = self._vm["embed"]
        self._prefill = self._vm["batch_prefill"]
        self._prefill_hidden = self._vm["batch_prefill_hidden"]
        self._decode = self._vm["batch_decode"]
        self._decode_one = self._vm["decode_one"]

        self.page_size = page_size
        self.max_num_seqs = options.max_num_seqs
        # a network may bound its chunks (Gemma 3 on CUDA: no longer than its window)
        limit = facts["max_prefill_chunk"]
        self.prefill_chunk_size = min(options.prefill_chunk_size, limit or options.prefill_chunk_size)
        self.shares_prefixes = facts["shares_prefixes"]
        if cuda:
            # Padding sequences hold a page each during a step and none
            # between steps; a decode batch past the buckets is one prefill
            # of a token each.
            chunk = max(self.prefill_chunk_size, options.max_num_seqs if buckets else 0)
            self._kv = TVMCache(self._vm, page_size, options.max_num_seqs, pages, chunk, self._max_pad)
        else:
            self._kv = CPUCache(config, pages, self.device)
        self.total_pages = self._kv.total_pages
        self.max_sequence_length = min(config.context_length, self.total_pages * self.page_size)
        self.vocab_size = config.vocab_size
        self._lengths: dict[int, int] = {}
        self._closed = False
        self._trimmer = Trimmer() if not cuda else None
        # device sampling: the logits stay where they are and `sample` runs
        # the sampler's kernels on them; off (None), logits come back as numpy
        self._sampler = None
        if cuda if tvm_options.device_sampling is None else tvm_options.device_sampling:
            from lockgate.plugins.tvm.compile_cache import default_cache_dir
            from lockgate.plugins.tvm.sampler import DeviceSampler

            self._progress("loading the sampler…")
            self._sampler = DeviceSampler(
                self.vocab_size,
                kind,
                self.device,
                tvm_options.cache_dir if tvm_options.cache_dir is not None else default_cache_dir(),
            )
        self._progress("model ready")

    # sequences

    def add_sequence(self, seq_id: int) -> None:
        self._check_open()
        seq_id = self._as_id(seq_id)
        if seq_id in self._lengths:
            raise ValueError(f"sequence {seq_id} already exists")
        self._kv.add(seq_id)
        self._lengths[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        self._check_open()
        seq_id = self._known(seq_id)
        self._kv.remove(seq_id)
        del self._lengths[seq_id]

    def fork_sequence(self, parent_id: int, child_id: int, position: int | None = None) -> None:
        self._check_open()
        if not self.shares_prefixes:
            raise ValueError("this model's sequences cannot be forked (shares_prefixes is False)")
        parent_id = self._known(parent_id)
        child_id = self._as_id(child_id)
        if child_id in self._lengths:
            raise ValueError(f"sequence {child_id} already exists")
        length = self._lengths[parent_id]
        position = length if position is None else int(position)
        if length == 0:
            raise ValueError(f"cannot fork sequence {parent_id}: it holds no tokens yet")
        if not 0 < position <= length:
            raise ValueError(f"cannot fork sequence {parent_id} at {position}: it holds {length} tokens")
        # The child shares the full pages and gets its own copy of a partly
        # filled page at the fork position.
        if position % self.page_size and self.free_pages() < 1:
            raise ValueError(f"cannot fork sequence {parent_id}: no free KV page for the page at {position}")
        self._kv.fork(parent_id, child_id, position)
        self._lengths[child_id] = position

    def truncate(self, seq_id: int, length: int) -> None:
        self._check_open()
        seq_id = self._known(seq_id)
        held = self._lengths[seq_id]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= held:
            raise ValueError(f"cannot truncate sequence {seq_id} to {length!r}: it holds {held} tokens")
        self._kv.truncate(seq_id, int(length), held)
        self._lengths[seq_id] = int(length)

    def free_pages(self) -> int:
        self._check_open()
        return self._kv.free_pages()

    def _set_decode_buckets(self, buckets: Sequence[int]) -> None:
        """Pad decode batches up to `buckets` (empty: never pad, as on the
        CPU, where no graph is captured and padding would be wasted work).
        Batches above the largest bucket go through `batch_prefill`."""
        self._buckets = tuple(sorted(b for b in buckets if b > 1))
        self._max_pad = 0
        previous = 1
        for bucket in self._buckets:
            self._max_pad = max(self._max_pad, bucket - previous - 1)
            previous = bucket

    # forward passes

    def prefill(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        all_positions: Sequence[bool] | None = None,
    ) -> np.ndarray:
        out, rows = self._prefill_rows(self._prefill, seq_ids, token_ids, all_positions)
        if self._sampler is not None:
            return self._on_device(out, rows)
        return out.reshape(rows, self.vocab_size)

    def prefill_hidden(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        all_positions: Sequence[bool] | None = None,
    ) -> np.ndarray:
        out, rows = self._prefill_rows(self._prefill_hidden, seq_ids, token_ids, all_positions, host=True)
        return out.reshape(rows, self.config.hidden_size)

    def _prefill_rows(self, function, seq_ids, token_ids, all_positions, host: bool = False):
        """Run the prefill-shaped `function` (`batch_prefill` or
        `batch_prefill_hidden`) over the chunks, with the rows `prefill`
        documents; its output (on the host when `host` or without device
        sampling) and the number of rows."""
        self._check_open()
        ids = self._batch_ids(seq_ids)
        if len(token_ids) != len(ids):
            raise ValueError(f"{len(ids)} sequence ids but {len(token_ids)} token chunks")
        chunks = [self._tokens(chunk) for chunk in token_ids]
        lengths = [len(c) for c in chunks]
        if any(n == 0 for n in lengths):
            raise ValueError("every prefill chunk must hold at least one token")
        total = sum(lengths)
        if total > self.prefill_chunk_size:
            raise ValueError(
                f"prefill of {total} tokens exceeds prefill_chunk_size {self.prefill_chunk_size}"
            )
        self._check_room(ids, lengths)
        flat = np.concatenate(chunks)
        embeds = self._embed_tokens(flat).view_as((1, total, self.config.hidden_size))
        ends = np.cumsum(lengths, dtype=np.int32)
        if all_positions is None or not any(all_positions):
            positions = ends - 1
        else:
            # the positions (in the flat chunk) whose rows come back
            positions = np.concatenate([
                np.arange(end - n, end, dtype=np.int32) if every else np.array([end - 1], dtype=np.int32)
                for end, n, every in zip(ends, lengths, all_positions)
            ])
        rows = len(positions)
        positions = self._to_device(positions)
        out = self._forward(
            ids, lengths, lambda kv: function(embeds.tensor, positions, kv, self._params), prefill=True,
            host=host,
        )
        if total >= LARGE_PREFILL_TOKENS and self._trimmer is not None:
            self._trimmer.after_large_work()
        return out, rows

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self._check_open()
        ids = self._batch_ids(seq_ids)
        tokens = self._tokens(token_ids)
        if len(tokens) != len(ids):
            raise ValueError(f"{len(ids)} sequence ids but {len(tokens)} tokens")
        lengths = [1] * len(ids)
        self._check_room(ids, lengths)
        n = len(ids)
        bucket = next((b for b in self._buckets if b >= n), None) if n > 1 else 1
        if self._buckets and bucket is None:
            # past the buckets: the prefill function with one token per
            # sequence, every row's logits wanted
            embeds = self._embed_tokens(tokens).view_as((1, n, self.config.hidden_size))
            positions = self._to_device(np.arange(n, dtype=np.int32))
            logits = self._forward(
                ids, lengths, lambda kv: self._prefill(embeds.tensor, positions, kv, self._params), prefill=True
            )
            if self._sampler is not None:
                return self._on_device(logits, n)
            return logits.reshape(n, self.vocab_size)
        pad = (bucket - n) if self._buckets else 0
        pad_ids = [_PAD_ID_BASE + i for i in range(pad)]
        for pad_id in pad_ids:
            self._kv.add(pad_id)
        try:
            padded = np.concatenate([tokens, np.zeros(pad, dtype=np.int32)])
            embeds = self._embed_tokens(padded).view_as((n + pad, 1, self.config.hidden_size))
            decode = self._decode_one if n + pad == 1 else self._decode
            logits = self._forward(
                ids + pad_ids,
                lengths + [1] * pad,
                lambda kv: decode(embeds.tensor, kv, self._params),
                keep=n,
            )
        finally:
            for pad_id in pad_ids:
                self._kv.remove(pad_id)
        if self._sampler is not None:
            # the padding rows are left out of the index
            return self._on_device(logits, n)
        return logits[:n].reshape(n, self.vocab_size)

    def sample(self, logits, rows):
        """The device sampler on `DeviceLogits` (its rows gathered on the
        device); numpy logits go to the host sampler."""
        if not isinstance(logits, DeviceLogits):
            return super().sample(logits, rows)
        if self._sampler is None:
            raise RuntimeError("DeviceLogits given to an executor without device sampling")
        if len(logits) != len(rows):
            logits = logits[: len(rows)]
        return self._sampler.sample_batch(self._sampler.rows(logits.tensor, logits.index), rows)

    def set_instrument(self, instrument) -> None:
        """Have the VM call `instrument(func, name, before, result, *args)`
        before and after every function it calls (returning 0 to go on):
        per-kernel timing for `benchmarks/step_profile.py`."""
        self._vm["set_instrument"](runtime.tvm_ffi.convert(instrument))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._trimmer is not None:
            self._trimmer.close()
        self._kv = None
        self._params = None
        self._embed = self._prefill = self._prefill_hidden = self._decode = self._decode_one = None
        self._vm = None
        self._sampler = None
        self._lengths.clear()

    # helpers

    def _forward(self, ids: list[int], lengths: list[int], run, keep: int | None = None, prefill: bool = False,
                 host: bool = False):
        """Run one step over `ids` (`run(kv)` calls the compiled function
        with the cache's argument); only the first `keep` (default all) are
        the caller's sequences, the rest padding. The output as a host
        array, or the device tensor itself with device sampling on (unless
        `host`)."""
        for seq_id, n in list(zip(ids, lengths))[:keep]:
            self._lengths[seq_id] += n
        out = self._kv.forward(ids, lengths, run, prefill=prefill)
        logits = out if hasattr(out, "shape") else out[0]
        if self._sampler is not None and not host:
            return logits
        return np.asarray(runtime.to_numpy(logits), dtype=np.float32)

    def _on_device(self, tensor, n: int) -> DeviceLogits:
        """The first `n` rows of the `[..., vocab]` logits `tensor`, left
        on the device."""
        held = math.prod(int(d) for d in tensor.shape) // self.vocab_size
        view = tensor if len(tensor.shape) == 2 else runtime.create_view(tensor, (held, self.vocab_size))
        return DeviceLogits(tensor, view, np.arange(n, dtype=np.int64))

    def _embed_tokens(self, tokens: np.ndarray) -> View:
        out = self._embed(self._to_device(tokens), self._params)
        return View(out)

    def _to_device(self, array: np.ndarray):
        return runtime.from_numpy(np.ascontiguousarray(array, dtype=np.int32), self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the executor is closed")


def create_executor(model_file: ModelFile, options: ExecutorOptions) -> TVMExecutor:
    """Build a `TVMExecutor`: compile (or take from the cache), load the
    GGUF weights and allocate the KV cache."""
    return TVMExecutor(model_file, options)
