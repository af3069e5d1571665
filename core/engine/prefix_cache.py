"""Automatic prefix caching: KV pages of finished sequences stay in the cache,
indexed by their tokens, and a new sequence forks from the longest cached
prefix of its tokens instead of prefilling it again.

Two parts:

* `PageBook` keeps the paged KV cache's books on the Python side, page by
  page, the way the executor allocates: a sequence holds ceil(length /
  page_size) pages, a fork at position p shares the parent's first
  floor(p / page_size) pages and copies the partly filled one, and a page
  returns to the pool when no sequence holds it. From it the scheduler
  knows how many pages an eviction freed and how many pages only cached
  sequences hold (the `kv_pages_cached` gauge). Tests check it against the
  executor's own count after every step.
* `PrefixCache` holds the cached sequences (ids and tokens) and finds the
  longest prefix of a token list that one of them, or a running sequence
  offered to `longest_prefix`, already has in the KV cache.

Why a list scanned with numpy rather than a radix tree or block hashes: a
cached sequence holds at least one page, so there are at most as many as the
cache has pages, and in practice tens; comparing a prompt against each is one
vectorized comparison, microseconds apiece. The scan also finds a match that
ends in the middle of a page (the executor forks there, copying that page),
which block hashes cannot, and it needs no re-indexing as running sequences
grow or splitting and holder bookkeeping on each eviction, as a radix tree
would.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


class PageBook:
    """Which KV pages each sequence holds, as the executor allocates them."""

    def __init__(self, page_size: int, total_pages: int) -> None:
        self.page_size = page_size
        self.total_pages = total_pages
        self._pages: dict[int, list[int]] = {}
        self._holders: collections.Counter[int] = collections.Counter()
        self._next_page = itertools.count()

    @property
    def free(self) -> int:
        return self.total_pages - len(self._holders)

    def _new_page(self) -> int:
        page = next(self._next_page)
        self._holders[page] = 1
        return page

    def add(self, seq_id: int) -> None:
        self._pages[seq_id] = []

    def fork(self, parent_id: int, child_id: int, position: int) -> None:
        """`child_id` holds the first `position` tokens of `parent_id`."""
        full, partial = divmod(position, self.page_size)
        shared = self._pages[parent_id][:full]
        for page in shared:
            self._holders[page] += 1
        self._pages[child_id] = shared + ([self._new_page()] if partial else [])

    def grow(self, seq_id: int, length: int) -> None:
        """The sequence now holds `length` tokens."""
        pages = self._pages[seq_id]
        while len(pages) * self.page_size < length:
            pages.append(self._new_page())

    def remove(self, seq_id: int) -> int:
        """Forget a sequence; returns the pages that went back to the pool."""
        freed = 0
        for page in self._pages.pop(seq_id):
            self._holders[page] -= 1
            if not self._holders[page]:
                del self._holders[page]
                freed += 1
        return freed

    def pages_held_only_by(self, seq_ids: Iterable[int]) -> int:
        """Pages that no sequence outside `seq_ids` holds."""
        inside: collections.Counter[int] = collections.Counter()
        for seq_id in seq_ids:
            inside.update(self._pages[seq_id])
        return sum(1 for page, count in inside.items() if count == self._holders[page])


@dataclasses.dataclass
class CachedSequence:
    """A finished sequence kept in the KV cache: its id and the tokens its KV holds."""

    seq_id: int
    tokens: np.ndarray
    #: when it was last inserted or matched, on the cache's own clock
    last_used: int


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """Where a token list's longest cached prefix is: fork `seq_id` at `length`."""

    seq_id: int
    length: int


class PrefixCache:
    """Cached sequences, and the search for the longest prefix of a token list."""

    def __init__(self) -> None:
        self.entries: dict[int, CachedSequence] = {}
        self._clock = itertools.count()

    def longest_prefix(
        self,
        tokens: Sequence[int],
        limit: int,
        running: Iterable[tuple[int, np.ndarray]] = (),
    ) -> PrefixMatch | None:
        """The longest prefix of `tokens`, at most `limit` long, that a cached
        sequence or one of `running` ((seq_id, tokens in its KV)) holds.
        Longer matches win; among equal ones, a cached sequence."""
        if limit <= 0:
            return None
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best: PrefixMatch | None = None
        best_entry: CachedSequence | None = None
        candidates = [(e.seq_id, e.tokens, e) for e in self.entries.values()]
        candidates += [(seq_id, held, None) for seq_id, held in running]
        for seq_id, held, entry in candidates:
            if min(len(held), len(query)) <= (0 if best is None else best.length):
                continue
            length = common_prefix(held, query)
            if length > 0 and (best is None or length > best.length):
                best, best_entry = PrefixMatch(seq_id, length), entry
        if best_entry is not None:
            best_entry.last_used = next(self._clock)
        return best

    def insert(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Keep `seq_id`, whose KV holds `tokens`. Returns the sequences no
        longer worth keeping, for the caller to remove from the KV cache:
        cached ones whose tokens are a prefix of these, or this one itself
        when a cached sequence already holds all of its tokens."""
        held = np.asarray(tokens, dtype=np.int64)
        redundant = []
        for entry in list(self.entries.values()):
            n = min(len(entry.tokens), len(held))
            if not np.array_equal(entry.tokens[:n], held[:n]):
                continue
            if len(entry.tokens) >= len(held):
                entry.last_used = next(self._clock)
                return [seq_id]
            redundant.append(entry.seq_id)
            del self.entries[entry.seq_id]
        self.entries[seq_id] = CachedSequence(seq_id, held, next(self._clock))
        return redundant

    def least_recently_used(self, *, keep: int | None = None) -> int | None:
        """The cached sequence used longest ago, other than `keep`."""
        entries = [e for e in self.entries.values() if e.seq_id != keep]
        return min(entries, key=lambda e: e.last_used).seq_id if entries else None

    def discard(self, seq_id: int) -> None:
        del self.entries[seq_id]
