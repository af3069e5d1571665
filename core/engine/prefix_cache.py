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

Why a tree of whole pages: a large KV cache holds thousands of finished
sequences, and a search, an insertion or an eviction that looked at each of
them would cost milliseconds on every admission and every finished choice.
Following the tree costs one dictionary lookup per page of the prompt, and
tokens are compared one by one only inside the page where the path ends, so
a match that ends in the middle of a page (the executor forks there, copying
that page) is still found. Block hashes alone could not find it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


class PageBook:
    """Which KV pages each sequence holds, as the executor allocates them,
    and how many pages only cached sequences hold.

    That count is kept as pages change hands rather than counted when asked:
    it is read after every engine step, and a large KV cache holds
    thousands of cached sequences.
    """

    def __init__(self, page_size: int, total_pages: int) -> None:
        self.page_size = page_size
        self.total_pages = total_pages
        self._pages: dict[int, list[int]] = {}
        self._holders: collections.Counter[int] = collections.Counter()
        #: per page, how many of its holders are cached sequences
        self._cached_holders: collections.Counter[int] = collections.Counter()
        self._cached: set[int] = set()
        self._next_page = itertools.count()
        #: pages that only cached sequences hold
        self.cached_only = 0

    @property
    def free(self) -> int:
        return self.total_pages - len(self._holders)

    def _only_cached(self, page: int) -> bool:
        holders = self._holders.get(page, 0)
        return holders > 0 and self._cached_holders.get(page, 0) == holders

    def _hold(self, page: int, change: int, *, cached: bool) -> None:
        """One holder (cached or not) more (`change` 1) or fewer (-1) for `page`."""
        before = self._only_cached(page)
        self._holders[page] += change
        if not self._holders[page]:
            del self._holders[page]
        if cached:
            self._cached_holders[page] += change
            if not self._cached_holders[page]:
                del self._cached_holders[page]
        self.cached_only += self._only_cached(page) - before

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
            self._hold(page, 1, cached=False)
        self._pages[child_id] = shared + ([self._new_page()] if partial else [])

    def grow(self, seq_id: int, length: int) -> None:
        """The sequence now holds `length` tokens."""
        pages = self._pages[seq_id]
        while len(pages) * self.page_size < length:
            pages.append(self._new_page())

    def truncate(self, seq_id: int, length: int) -> None:
        """A running sequence (cached ones are never truncated) now holds
        its first `length` tokens: the pages past them go back, and a page
        the cut falls inside that others hold is replaced by a copy, as the
        executor does."""
        pages = self._pages[seq_id]
        keep = -(-length // self.page_size)
        for page in pages[keep:]:
            self._hold(page, -1, cached=False)
        del pages[keep:]
        if length % self.page_size and pages and self._holders[pages[-1]] > 1:
            self._hold(pages[-1], -1, cached=False)
            pages[-1] = self._new_page()

    def mark_cached(self, seq_id: int) -> None:
        """The sequence now belongs to the prefix cache."""
        self._cached.add(seq_id)
        for page in self._pages[seq_id]:
            before = self._only_cached(page)
            self._cached_holders[page] += 1
            self.cached_only += self._only_cached(page) - before

    def remove(self, seq_id: int) -> int:
        """Forget a sequence; returns the pages that went back to the pool."""
        cached = seq_id in self._cached
        self._cached.discard(seq_id)
        freed = 0
        for page in self._pages.pop(seq_id):
            self._hold(page, -1, cached=cached)
            if page not in self._holders:
                freed += 1
        return freed

    def pages_held_only_by(self, seq_ids: Iterable[int]) -> int:
        """Pages that no sequence outside `seq_ids` holds, counted afresh
        (tests check `cached_only` against it)."""
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


class _Node:
    """A node of the cache's page tree: the entries that hold one run of
    whole pages, by the page after it (`children`) or by the fewer than a
    page of tokens they end with (`tails`).

    `keys` holds the children's pages and the tails together, sorted: the
    ones sharing the longest start with some tokens are next to where those
    tokens would sort, so a node with thousands of them is searched by
    bisection, not scanned.
    """

    __slots__ = ("children", "tails", "keys", "through")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        #: entries that end here, by their last (fewer than page_size) tokens
        self.tails: dict[tuple[int, ...], int] = {}
        self.keys: list[tuple[int, ...]] = []
        #: entries that hold this node's whole prefix, in the order they came
        self.through: dict[int, None] = {}

    def holder(self, key: tuple[int, ...]) -> int:
        """An entry that holds `key` after this node's prefix."""
        child = self.children.get(key)
        return next(iter(child.through)) if child is not None else self.tails[key]

    def add_key(self, key: tuple[int, ...]) -> None:
        bisect.insort(self.keys, key)

    def remove_key(self, key: tuple[int, ...]) -> None:
        del self.keys[bisect.bisect_left(self.keys, key)]

    def longest_start(self, tokens: tuple[int, ...]) -> tuple[int, tuple[int, ...] | None]:
        """The most leading tokens of `tokens` a key shares, and that key."""
        keys = self.keys
        at = bisect.bisect_left(keys, tokens)
        best, best_key = 0, None
        for key in keys[max(at - 1, 0) : at + 1]:
            if (n := _shared(key, tokens)) > best:
                best, best_key = n, key
        return best, best_key

    def key_starting_with(self, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        """A key that begins with `tokens` (is it, or is longer), if any."""
        keys = self.keys
        at = bisect.bisect_left(keys, tokens)
        if at < len(keys) and keys[at][: len(tokens)] == tokens:
            return keys[at]
        return None


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Cached sequences, and the search for the longest prefix of a token list.

    Entries are indexed by a tree of whole pages, so a search follows one
    path of it and, where that path ends, bisects the sorted pages and tails
    that go on from there, however many sequences the cache holds. No entry
    is a prefix of another: `insert` drops the shorter one.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        #: the cached sequences, least recently used first
        self.entries: dict[int, CachedSequence] = {}
        self._root = _Node()
        self._clock = itertools.count()

    def _pages(self, tokens: list[int]) -> Iterator[tuple[int, ...]]:
        size = self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            yield tuple(tokens[start : start + size])

    def _touch(self, entry: CachedSequence) -> None:
        entry.last_used = next(self._clock)
        self.entries[entry.seq_id] = self.entries.pop(entry.seq_id)

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
        query = tokens[:limit]
        query = query.tolist() if isinstance(query, np.ndarray) else list(query)
        best: PrefixMatch | None = None
        node, depth = self._root, 0
        for page in self._pages(query):
            child = node.children.get(page)
            if child is None:
                break
            node, depth = child, depth + 1
        if depth:
            best = PrefixMatch(next(iter(node.through)), depth * self.page_size)
        rest = tuple(query[depth * self.page_size : (depth + 1) * self.page_size])
        if rest:
            extra, key = node.longest_start(rest)
            if key is not None:
                best = PrefixMatch(node.holder(key), depth * self.page_size + extra)
        cached = best
        held_query: np.ndarray | None = None
        for seq_id, held in running:
            length = 0 if best is None else best.length
            if min(len(held), len(query)) <= length:
                continue
            if length and held[length] != query[length]:
                continue  # cannot be longer than the best so far
            if held_query is None:
                held_query = np.asarray(query, dtype=np.int64)
            length = common_prefix(held, held_query)
            if length > 0 and (best is None or length > best.length):
                best = PrefixMatch(seq_id, length)
        if best is not None and best is cached:
            self._touch(self.entries[best.seq_id])
        return best

    def insert(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Keep `seq_id`, whose KV holds `tokens`. Returns the sequences no
        longer worth keeping, for the caller to remove from the KV cache:
        cached ones whose tokens are a prefix of these, or this one itself
        when a cached sequence already holds all of its tokens."""
        held = np.asarray(tokens, dtype=np.int64)
        listed = held.tolist()
        size = self.page_size
        full = len(listed) // size
        tail = tuple(listed[full * size :])
        path = [self._root]
        for page in self._pages(listed):
            child = path[-1].children.get(page)
            if child is None:
                break
            path.append(child)
        if len(path) == full + 1:  # a cached sequence may hold all of these tokens
            end = path[-1]
            covering = None
            if not tail:
                covering = next(iter(end.through), None)
            elif (key := end.key_starting_with(tail)) is not None:
                covering = end.holder(key)
            if covering is not None:
                self._touch(self.entries[covering])
                return [seq_id]
        # a cached sequence that is a prefix of this one ends on its path,
        # with a tail that begins the page there
        redundant = []
        for depth, node in enumerate(path):
            if not node.tails:
                continue
            segment = listed[depth * size : (depth + 1) * size]
            for length in range(len(segment) + 1):
                other = node.tails.get(tuple(segment[:length]))
                if other is not None:
                    redundant.append(other)
        for other in redundant:
            self.discard(other)
        node = self._root
        for page in self._pages(listed):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node()
                node.add_key(page)
            node = child
            node.through[seq_id] = None
        node.tails[tail] = seq_id
        node.add_key(tail)
        self.entries[seq_id] = CachedSequence(seq_id, held, next(self._clock))
        return redundant

    def least_recently_used(self, *, keep: int | None = None) -> int | None:
        """The cached sequence used longest ago, other than `keep`."""
        return next((seq_id for seq_id in self.entries if seq_id != keep), None)

    def discard(self, seq_id: int) -> None:
        entry = self.entries.pop(seq_id)
        listed = entry.tokens.tolist()
        node, path = self._root, []
        for page in self._pages(listed):
            path.append((node, page))
            node = node.children[page]
            del node.through[seq_id]
        tail = tuple(listed[len(path) * self.page_size :])
        del node.tails[tail]
        node.remove_key(tail)
        for parent, page in reversed(path):  # prune the pages no entry holds any more
            if parent.children[page].through:
                break
            del parent.children[page]
            parent.remove_key(page)
