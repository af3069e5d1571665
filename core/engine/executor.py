"""The executor interface: what the engine asks of a compiled model, next
to the engine that calls it.

An executor owns the weights and a paged KV cache and runs forward passes for
sequences the engine names by integer ids. It knows nothing of requests,
sampling or HTTP. Executors are provided by plugins through
`lockgate_register_executors`; the built-in one is `tvm`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lockgate.engine.sampling import SamplingRow, TokenLogprob, sample_batch
from lockgate.settings import setting_default

if TYPE_CHECKING:
    from lockgate.models.model_file import ModelFile


@dataclasses.dataclass(frozen=True)
class ExecutorOptions:
    """Sizing of an executor, from the CLI or environment, and the settings
    plugins add, from which an executor reads its own (the TVM executor its
    target, threads, cache directory, ...)."""

    #: most sequences decoded in one step (the KV cache's batch dimension)
    max_num_seqs: int = setting_default("max_num_seqs")
    #: tokens the KV cache holds over all sequences together
    max_total_tokens: int = setting_default("max_total_tokens")
    #: most tokens one prefill call may carry (longer prompts are chunked)
    prefill_chunk_size: int = setting_default("prefill_chunk_size")
    #: values of the settings plugins add (`lockgate_add_settings`), by name;
    #: one not given is absent, and its plugin's default applies
    plugin_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: called with one-line progress messages while compiling and loading
    progress: Callable[[str], None] | None = None
    #: called once before the weights and the KV cache are allocated, with
    #: the bytes they will take (`Executor.memory`'s keys); it may block
    #: until there is room, or raise to refuse the load (the memory budget
    #: of a server with several models)
    reserve: Callable[[dict[str, int]], None] | None = None

    @classmethod
    def of(cls, **values: Any) -> "ExecutorOptions":
        """Options from values by name: this class's fields, and the rest as
        plugin settings (`ExecutorOptions.of(max_num_seqs=2, cache_dir=d)`)."""
        own = {field.name for field in dataclasses.fields(cls)}
        plugin = {name: value for name, value in values.items() if name not in own}
        return cls(**{name: value for name, value in values.items() if name in own},
                   plugin_settings={**values.get("plugin_settings", {}), **plugin})


class Executor(abc.ABC):
    """Forward passes over a paged KV cache.

    Sequence ids are chosen by the caller, unique among live sequences.
    Logits come back as float32 numpy arrays of shape (rows, vocab_size),
    or as an object standing for them that the executor's own `sample`
    understands (the TVM executor's `DeviceLogits`, left on the GPU); the
    engine only takes `len(logits)`, `logits.shape` and rows
    `logits[list_of_row_indices]` (repeats allowed) of them, and hands the
    rows to `sample` before the next `prefill` or `decode`.
    Methods are called from one thread (the engine's) at a time.
    """

    #: tokens per KV page
    page_size: int
    #: what the weights run as, for `/health` and the load log: {"formats":
    #: [{"format", "tensors", "bytes", "file_bytes"}, …], "widened": [{"tensor",
    #: "type", "bytes", "file_bytes"}, …]} (the TVM executor's
    #: `weights.load_report`); None when an executor does not say
    load_report: dict | None = None
    #: bytes the executor allocated: {"weights": ..., "kv_cache": ...} (what
    #: `ExecutorOptions.reserve` was told); None when an executor does not say
    memory: dict[str, int] | None = None
    #: KV pages in the cache
    total_pages: int
    #: most sequences in one decode call
    max_num_seqs: int
    #: most tokens in one prefill call
    prefill_chunk_size: int
    #: longest sequence (prompt + generated) the executor can hold
    max_sequence_length: int
    #: vocabulary size, the logits' second dimension
    vocab_size: int
    #: whether a forked sequence attends over its parent's KV pages as over
    #: its own; False (a model with sliding-window layers on TVM's CUDA
    #: cache) turns the prefix cache off and limits `n` to 1, and
    #: `fork_sequence` is never called
    shares_prefixes: bool = True

    @abc.abstractmethod
    def add_sequence(self, seq_id: int) -> None:
        """Create an empty sequence in the KV cache."""

    @abc.abstractmethod
    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence and return its KV pages to the pool."""

    @abc.abstractmethod
    def fork_sequence(self, parent_id: int, child_id: int, position: int | None = None) -> None:
        """Create `child_id` holding the first `position` tokens of
        `parent_id`'s KV (all of them when None), sharing its full pages;
        a partly filled page at `position` is copied, so it needs one free
        page."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens of `seq_id` in the KV cache and
        drop the rest, as if they had never been appended (speculative
        decoding takes rejected drafts back this way). An executor that
        cannot raises `NotImplementedError` (`can_truncate` is then false,
        and the engine does not speculate on it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate a sequence")

    @property
    def can_truncate(self) -> bool:
        """Whether `truncate` is implemented."""
        return type(self).truncate is not Executor.truncate

    @abc.abstractmethod
    def prefill(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        all_positions: Sequence[bool] | None = None,
    ) -> np.ndarray:
        """Append each chunk of tokens to its sequence.

        The chunks together hold at most `prefill_chunk_size` tokens; each is
        non-empty. Returns the logits after the last token of every chunk,
        shape (len(seq_ids), vocab_size); a chunk `i` with
        `all_positions[i]` true has a row after each of its tokens instead
        (`len(token_ids[i])` rows, in order, its last row the last token's),
        for prompt logprobs. Rows follow the chunks' order.
        """

    def prefill_hidden(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        all_positions: Sequence[bool] | None = None,
    ) -> np.ndarray:
        """`prefill`, returning the model's final hidden states (after its
        last norm, before the LM head) instead of logits: float32, shape
        (rows, hidden size), the rows `prefill` would return. What
        embeddings pool and a classification head scores. An executor that
        cannot raises `NotImplementedError` (`can_embed` is then false, and
        embedding requests are refused)."""
        raise NotImplementedError(f"{type(self).__name__} cannot return hidden states")

    @property
    def can_embed(self) -> bool:
        """Whether `prefill_hidden` is implemented."""
        return type(self).prefill_hidden is not Executor.prefill_hidden

    @abc.abstractmethod
    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence (at most `max_num_seqs`) and
        return the next-token logits, shape (len(seq_ids), vocab_size)."""

    def sample(self, logits, rows: Sequence[SamplingRow]) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """Choose each row's next token from `logits` as `prefill`/`decode`
        returned them, after the engine selected rows from them with
        `logits[row_indices]`: row `i` of `logits` for `rows[i]`. Returns
        what `lockgate.engine.sampling.sample_batch` returns (the token ids,
        and each row's `TokenLogprob` when its parameters ask for logprobs).
        The default is that host sampler; an executor whose logits stay on
        its device overrides it to sample there."""
        return sample_batch(logits, rows)

    @abc.abstractmethod
    def free_pages(self) -> int:
        """KV pages not held by any sequence."""

    def close(self) -> None:
        """Release the cache and weights. Idempotent."""


ExecutorFactory = Callable[["ModelFile", ExecutorOptions], Executor]
