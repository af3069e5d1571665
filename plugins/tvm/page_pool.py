"""The CPU's KV cache at run time: the pages of `paged_attention`'s pools,
who holds them, and each step's page tables.

A sequence is a list of 16-token pages. Forking shares the parent's full
pages (counted per holder) and copies the partly filled one, and a
truncation inside a shared page copies it too, so a sequence only ever
writes to pages it alone holds. A step (`step`)
reserves the pages its new tokens need and returns what the compiled
functions read: each new token's position and slot, each sequence's page
list, and, for a prefill, where each sequence's queries start.

The pools are two float16 tensors the executor allocates once, `(layers,
pages, kv heads, head dim, 16)` for keys (feature-major in a page, as the
attention kernel reads them) and `(layers, pages, kv heads, 16, head dim)`
for values; copies of pages go through numpy views of them. This module
imports no part of TVM: a server that runs a cached library loads TVM's
runtime alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

#: tokens per KV page (the attention kernels are built for it)
PAGE_SIZE = 16


@dataclasses.dataclass
class _Sequence:
    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward pass's page tables (int32 numpy arrays)."""

    #: each new token's position in its sequence
    positions: np.ndarray
    #: each new token's slot: page * 16 + offset
    slots: np.ndarray
    #: sequence b's pages are `page_values[page_indptr[b]:page_indptr[b + 1]]`
    page_indptr: np.ndarray
    page_values: np.ndarray
    #: sequence b's new tokens are rows `q_indptr[b]:q_indptr[b + 1]`
    q_indptr: np.ndarray


class PagePool:
    """Pages of a KV pool of `num_pages` pages, and the sequences that hold
    them. `copy_page(src, dst)` copies a page's keys and values in every
    layer (the executor's, over its pools).

    Every method checks its arguments before it changes anything and raises
    `ValueError` for an unknown or existing sequence, a bad position, or
    too few free pages.
    """

    def __init__(self, num_pages: int, copy_page) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._copy_page = copy_page
        self._holders = np.zeros(num_pages, dtype=np.int32)
        # free pages, lowest first out
        self._free = list(range(num_pages - 1, -1, -1))
        self._sequences: dict[int, _Sequence] = {}

    # ------------------------------------------------------------ sequences

    def free_pages(self) -> int:
        return len(self._free)

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sequences

    def add(self, seq_id: int) -> None:
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id} already exists")
        self._sequences[seq_id] = _Sequence()

    def remove(self, seq_id: int) -> None:
        sequence = self._get(seq_id)
        del self._sequences[seq_id]
        self._release(sequence.pages)

    def fork(self, parent_id: int, child_id: int, position: int) -> None:
        """`child_id` holds the first `position` tokens of `parent_id`: its
        full pages shared, the page `position` ends inside copied."""
        parent = self._get(parent_id)
        if child_id in self._sequences:
            raise ValueError(f"sequence {child_id} already exists")
        if not 0 < position <= parent.length:
            raise ValueError(f"cannot fork sequence {parent_id} at {position}: it holds {parent.length} tokens")
        full, partial = divmod(position, PAGE_SIZE)
        if partial and not self._free:
            raise ValueError(f"cannot fork sequence {parent_id}: no free KV page for the page at {position}")
        pages = parent.pages[:full]
        self._holders[pages] += 1
        if partial:
            copy = self._take()
            self._copy_page(parent.pages[full], copy)
            pages = [*pages, copy]
        self._sequences[child_id] = _Sequence(list(pages), position)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens of `seq_id`: the pages past them go
        back, and a page the cut falls inside that another sequence holds is
        copied (the sequence writes there next), as a fork copies it."""
        sequence = self._get(seq_id)
        if not 0 <= length <= sequence.length:
            raise ValueError(f"cannot truncate sequence {seq_id} to {length}: it holds {sequence.length} tokens")
        keep = -(-length // PAGE_SIZE)
        copy = length % PAGE_SIZE and self._holders[sequence.pages[keep - 1]] > 1
        if copy and not self._free:
            raise ValueError(f"cannot truncate sequence {seq_id}: no free KV page for the page at {length}")
        self._release(sequence.pages[keep:])
        del sequence.pages[keep:]
        if copy:
            shared = sequence.pages[-1]
            sequence.pages[-1] = self._take()
            self._copy_page(shared, sequence.pages[-1])
            self._release([shared])
        sequence.length = length

    # ------------------------------------------------------------ steps

    def pages_needed(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> int:
        """Free pages a step appending `lengths[i]` tokens to each sequence takes."""
        needed = 0
        for seq_id, n in zip(seq_ids, lengths):
            sequence = self._get(seq_id)
            needed += -(-(sequence.length + n) // PAGE_SIZE) - len(sequence.pages)
            if sequence.length % PAGE_SIZE and self._holders[sequence.pages[-1]] > 1:
                needed += 1  # a shared page written to is copied first
        return needed

    def step(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> Step:
        """Append `lengths[i]` tokens to each sequence: reserve their pages
        and return the step's page tables."""
        needed = self.pages_needed(seq_ids, lengths)
        if needed > len(self._free):
            raise ValueError(f"{needed} KV pages needed but only {len(self._free)} are free")
        positions, page_lists = [], []
        for seq_id, n in zip(seq_ids, lengths):
            sequence = self._sequences[seq_id]
            start = sequence.length
            if start % PAGE_SIZE and self._holders[sequence.pages[-1]] > 1:
                shared = sequence.pages[-1]
                sequence.pages[-1] = self._take()
                self._copy_page(shared, sequence.pages[-1])
                self._release([shared])
            while len(sequence.pages) * PAGE_SIZE < start + n:
                sequence.pages.append(self._take())
            sequence.length = start + n
            positions.append(np.arange(start, start + n, dtype=np.int32))
            page_lists.append(np.asarray(sequence.pages, dtype=np.int32))
        positions_all = np.concatenate(positions)
        counts = np.fromiter((len(p) for p in page_lists), dtype=np.int32, count=len(page_lists))
        page_indptr = np.zeros(len(page_lists) + 1, dtype=np.int32)
        np.cumsum(counts, out=page_indptr[1:])
        page_values = np.concatenate(page_lists)
        q_indptr = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(np.asarray(lengths, dtype=np.int32), out=q_indptr[1:])
        # a token's page: its sequence's list at position // 16
        owner = np.repeat(np.arange(len(page_lists)), lengths)
        pages_of_tokens = page_values[page_indptr[owner] + positions_all // PAGE_SIZE]
        slots = (pages_of_tokens * PAGE_SIZE + positions_all % PAGE_SIZE).astype(np.int32)
        return Step(positions_all, slots, page_indptr, page_values, q_indptr)

    # ------------------------------------------------------------ pages

    def _get(self, seq_id: int) -> _Sequence:
        sequence = self._sequences.get(seq_id)
        if sequence is None:
            raise ValueError(f"unknown sequence id {seq_id}")
        return sequence

    def _take(self) -> int:
        page = self._free.pop()
        self._holders[page] = 1
        return page

    def _release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)
