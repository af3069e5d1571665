"""Test double: an executor without a model, for testing the scheduler and
the engine loop without TVM.

It keeps a paged KV cache's books the way TVM's does: each sequence holds a
list of pages, a page holds `page_size` tokens, a fork shares the parent's
full pages and copies its partly filled last one, and a page returns to the
pool when no sequence holds it. It also remembers each sequence's tokens,
so its "logits" can depend on the whole sequence: the next token it favours
is a hash of every token so far. A scheduler that lost, repeated or
reordered a token (in a preemption, a fork, a prefill chunk) changes what
is generated, and a page it miscounted shows in `free_pages`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from lockgate.engine.executor import Executor


class FakeExecutor(Executor):
    def __init__(
        self,
        *,
        vocab_size: int = 300,
        page_size: int = 4,
        total_pages: int = 64,
        max_num_seqs: int = 8,
        prefill_chunk_size: int = 16,
        max_sequence_length: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.total_pages = total_pages
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.max_sequence_length = max_sequence_length
        self.tokens: dict[int, list[int]] = {}
        self.pages: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._free = list(range(total_pages))
        #: every forward pass: ("prefill" | "decode", {seq_id: tokens})
        self.calls: list[tuple[str, dict[int, int]]] = []

    # ------------------------------------------------------------ pages

    def _take_page(self) -> int:
        if not self._free:
            raise RuntimeError("out of KV pages")  # the scheduler must never let this happen
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _drop_page(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            del self._refs[page]
            self._free.append(page)

    def free_pages(self) -> int:
        return len(self._free)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tokens:
            raise ValueError(f"sequence {seq_id} exists")
        self.tokens[seq_id] = []
        self.pages[seq_id] = []

    def remove_sequence(self, seq_id: int) -> None:
        if seq_id not in self.tokens:
            raise ValueError(f"no sequence {seq_id}")
        for page in self.pages.pop(seq_id):
            self._drop_page(page)
        del self.tokens[seq_id]

    def fork_sequence(self, parent_id: int, child_id: int, position: int | None = None) -> None:
        if child_id in self.tokens:
            raise ValueError(f"sequence {child_id} exists")
        held = len(self.tokens[parent_id])
        position = held if position is None else position
        if not 0 < position <= held:
            raise ValueError(f"cannot fork {parent_id} at {position}: it holds {held} tokens")
        full, partial = divmod(position, self.page_size)
        shared = self.pages[parent_id][:full]
        for page in shared:
            self._refs[page] += 1
        # the partly filled page at the fork position is copied
        self.pages[child_id] = shared + ([self._take_page()] if partial else [])
        self.tokens[child_id] = self.tokens[parent_id][:position]

    def truncate(self, seq_id: int, length: int) -> None:
        tokens = self.tokens[seq_id]
        if not 0 <= length <= len(tokens):
            raise ValueError(f"cannot truncate {seq_id} to {length}: it holds {len(tokens)} tokens")
        keep = -(-length // self.page_size)
        pages = self.pages[seq_id]
        for page in pages[keep:]:
            self._drop_page(page)
        del pages[keep:]
        if length % self.page_size and self._refs[pages[-1]] > 1:
            # the page the cut falls inside is shared: the sequence gets its own copy
            self._drop_page(pages[-1])
            pages[-1] = self._take_page()
        del tokens[length:]

    def _append(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        tokens = self.tokens[seq_id]
        for token in token_ids:
            if len(tokens) % self.page_size == 0:
                self.pages[seq_id].append(self._take_page())
            tokens.append(int(token))
        if len(tokens) > self.max_sequence_length:
            raise ValueError(f"sequence {seq_id} is longer than {self.max_sequence_length}")
        return self._logits(tokens)

    def _logits(self, tokens: list[int]) -> np.ndarray:
        favoured = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes()) % self.vocab_size
        row = np.zeros(self.vocab_size, dtype=np.float32)
        row[favoured] = 10.0
        row[(favoured + 1) % self.vocab_size] = 9.0  # a runner-up, for sampling to choose
        return row

    # ------------------------------------------------------------ forward passes

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]],
                all_positions: Sequence[bool] | None = None) -> np.ndarray:
        if sum(len(t) for t in token_ids) > self.prefill_chunk_size or not all(token_ids):
            raise ValueError("a prefill call carries 1 .. prefill_chunk_size tokens per chunk")
        self.calls.append(("prefill", {s: len(t) for s, t in zip(seq_ids, token_ids)}))
        rows = []
        for i, (seq_id, chunk) in enumerate(zip(seq_ids, token_ids)):
            if all_positions is not None and all_positions[i]:
                # every position's row: the logits after each token in turn
                rows += [self._append(seq_id, [token]) for token in chunk]
            else:
                rows.append(self._append(seq_id, chunk))
        return np.stack(rows)

    #: features of a `prefill_hidden` row
    HIDDEN = 8

    def hidden_after(self, tokens: Sequence[int]) -> np.ndarray:
        """The "final hidden state" after `tokens`: like the logits, a hash
        of every token so far, so a lost or repeated token changes it."""
        crc = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
        return np.array([(crc >> (4 * k)) & 0xF for k in range(self.HIDDEN)], dtype=np.float32)

    def prefill_hidden(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]],
                       all_positions: Sequence[bool] | None = None) -> np.ndarray:
        if sum(len(t) for t in token_ids) > self.prefill_chunk_size or not all(token_ids):
            raise ValueError("a prefill call carries 1 .. prefill_chunk_size tokens per chunk")
        self.calls.append(("prefill_hidden", {s: len(t) for s, t in zip(seq_ids, token_ids)}))
        rows = []
        for i, (seq_id, chunk) in enumerate(zip(seq_ids, token_ids)):
            chunk_rows = []
            for token in chunk:
                self._append(seq_id, [token])
                chunk_rows.append(self.hidden_after(self.tokens[seq_id]))
            rows += chunk_rows if all_positions is not None and all_positions[i] else chunk_rows[-1:]
        return np.stack(rows)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        if len(seq_ids) > self.max_num_seqs:
            raise ValueError("more rows than max_num_seqs")
        self.calls.append(("decode", {s: 1 for s in seq_ids}))
        return np.stack([self._append(s, [t]) for s, t in zip(seq_ids, token_ids)])


#: tokens per KV page of a test double served as a model's executor (the TVM executor's length)
PAGE_SIZE = 16


def sizes_for(model_file, options) -> dict:
    """A `FakeExecutor`'s sizes when it stands in as a model's executor: the
    model's vocabulary and context, the server's executor options."""
    return dict(
        vocab_size=model_file.config.vocab_size,
        page_size=PAGE_SIZE,
        total_pages=options.max_total_tokens // PAGE_SIZE,
        max_num_seqs=options.max_num_seqs,
        prefill_chunk_size=options.prefill_chunk_size,
        max_sequence_length=model_file.config.context_length,
    )


def expected_greedy(executor: FakeExecutor, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What greedy decoding of `prompt` must produce on this executor, worked
    out from its logits alone (no scheduler involved)."""
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = int(np.argmax(executor._logits(tokens)))
        out.append(token)
        tokens.append(token)
    return out
