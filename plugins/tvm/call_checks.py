"""The checks the TVM executor runs on what its caller passes before the KV
cache is touched: sequence ids (integers in range, known or new, none twice
in a call), token ids (a flat array inside the vocabulary) and the room a
step needs (the sequence's limit, free pages). Sequence lengths are
mirrored on the Python side (`_lengths`) for these checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: sequence ids from here up are the executor's own padding sequences
PAD_ID_BASE = 1 << 62


class CallerChecks:
    """Mixed into the executor, which holds `_lengths` (sequence id: tokens
    held), `max_num_seqs`, `vocab_size`, `max_sequence_length`,
    `page_size` and `free_pages()`; each check raises `ValueError`."""

    _lengths: dict[int, int]
    max_num_seqs: int
    vocab_size: int
    max_sequence_length: int
    page_size: int

    @staticmethod
    def _as_id(seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise ValueError(f"sequence ids are integers, got {seq_id!r}")
        seq_id = int(seq_id)
        if not 0 <= seq_id < PAD_ID_BASE:
            raise ValueError(f"sequence ids are in [0, 2**62), got {seq_id}")
        return seq_id

    def _known(self, seq_id) -> int:
        seq_id = self._as_id(seq_id)
        if seq_id not in self._lengths:
            raise ValueError(f"unknown sequence id {seq_id}")
        return seq_id

    def _batch_ids(self, seq_ids: Sequence[int]) -> list[int]:
        ids = [self._known(s) for s in seq_ids]
        if not ids:
            raise ValueError("no sequences given")
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence id appears twice in one call")
        if len(ids) > self.max_num_seqs:
            raise ValueError(f"{len(ids)} sequences exceed max_num_seqs {self.max_num_seqs}")
        return ids

    def _tokens(self, tokens: Sequence[int]) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError("token ids must be a flat sequence of integers")
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        return array.astype(np.int32)

    def _check_room(self, ids: list[int], lengths: list[int]) -> None:
        needed = 0
        for seq_id, n in zip(ids, lengths):
            old = self._lengths[seq_id]
            if old + n > self.max_sequence_length:
                raise ValueError(
                    f"sequence {seq_id} would grow to {old + n} tokens, over the "
                    f"limit of {self.max_sequence_length}"
                )
            needed += -(-(old + n) // self.page_size) - (-(-old // self.page_size))
        free = self.free_pages()
        if needed > free:
            raise ValueError(f"{needed} KV pages needed but only {free} are free")
