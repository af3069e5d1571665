"""The prefix cache's page tree finds what a scan of every cached sequence
finds, and the page book's running count of pages only cached sequences
hold agrees with a count made afresh, step after step."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_executor import FakeExecutor
from lockgate.engine import Engine, EngineOptions, Work
from lockgate.engine.params import SamplingParams
from lockgate.engine.prefix_cache import PrefixCache
from lockgate.models.tokenizer import load_tokenizer


def shared_length(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ScanningCache:
    """The reference: a list of (seq_id, tokens), scanned whole every time."""

    def __init__(self) -> None:
        self.entries: dict[int, list[int]] = {}

    def longest(self, tokens: list[int], limit: int) -> int:
        return max((shared_length(held, tokens[:limit]) for held in self.entries.values()), default=0)

    def insert(self, seq_id: int, tokens: list[int]) -> list[int]:
        for held in self.entries.values():
            if held[: len(tokens)] == tokens:
                return [seq_id]
        redundant = [other for other, held in self.entries.items() if tokens[: len(held)] == held]
        for other in redundant:
            del self.entries[other]
        self.entries[seq_id] = tokens
        return redundant


TOKENS = st.lists(st.integers(0, 2), max_size=24)


@settings(max_examples=300, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    stems=st.lists(TOKENS, min_size=1, max_size=3),
    operations=st.lists(
        st.tuples(st.sampled_from(["insert", "search", "evict"]), st.integers(0, 2), st.integers(0, 24), TOKENS,
                  st.integers(0, 40)),
        max_size=40,
    ),
)
def test_the_page_tree_finds_what_a_scan_finds(page_size, stems, operations):
    cache, reference = PrefixCache(page_size), ScanningCache()
    seq_ids = iter(range(10_000))
    for kind, stem, cut, rest, limit in operations:
        tokens = stems[stem % len(stems)][:cut] + rest
        if kind == "insert" and tokens:
            seq_id = next(seq_ids)
            assert sorted(cache.insert(seq_id, tokens)) == sorted(reference.insert(seq_id, tokens))
        elif kind == "search" and tokens:
            match = cache.longest_prefix(tokens, limit)
            want = reference.longest(tokens, limit)
            assert (0 if match is None else match.length) == want
            if match is not None:  # the sequence named holds that prefix
                assert cache.entries[match.seq_id].tokens[: match.length].tolist() == tokens[: match.length]
        elif kind == "evict":
            seq_id = cache.least_recently_used()
            if seq_id is not None:
                cache.discard(seq_id)
                del reference.entries[seq_id]
        assert set(cache.entries) == set(reference.entries)


def test_a_match_ending_inside_a_page_is_found():
    cache = PrefixCache(4)
    cache.insert(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # two whole pages, then a tail of one
    assert cache.longest_prefix([1, 2, 3, 4, 5, 9, 9], 7).length == 5  # inside the second page
    assert cache.longest_prefix([1, 2, 9], 3).length == 2  # inside the first
    assert cache.longest_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9], 10).length == 9  # the whole tail
    assert cache.longest_prefix([9, 1, 2], 3) is None


def test_a_running_sequence_wins_only_when_longer():
    cache = PrefixCache(4)
    cache.insert(1, [5, 6, 7, 8, 9, 10])
    running = [(7, np.array([5, 6, 7, 8, 9, 10])), (8, np.array([5, 6, 7, 8, 9, 10, 11]))]
    assert cache.longest_prefix([5, 6, 7, 8, 9, 10, 11, 12], 8, running[:1]).seq_id == 1
    assert cache.longest_prefix([5, 6, 7, 8, 9, 10, 11, 12], 8, running).seq_id == 8


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf):
    return load_tokenizer(gguf.GGUFReader(tiny_gguf))


def test_the_count_of_cached_pages_is_kept_right_through_forks_evictions_and_preemptions(tokenizer):
    executor = FakeExecutor(vocab_size=290, page_size=4, total_pages=24, max_num_seqs=4, prefill_chunk_size=16,
                            max_sequence_length=64)
    engine = Engine(executor, tokenizer, eos_token_ids=[tokenizer.eos_token_id], context_length=64,
                    options=EngineOptions(prefix_cache=True, max_n=3))
    rng = np.random.default_rng(0)
    stems = [rng.integers(3, 290, size=size).tolist() for size in (9, 14, 21)]
    book, cache = engine.scheduler.book, engine.scheduler.cache
    checked = 0
    for i in range(60):
        prompt = stems[i % 3][: int(rng.integers(1, 22))] + rng.integers(3, 290, size=int(rng.integers(1, 8))).tolist()
        params = SamplingParams(n=int(rng.integers(1, 3)), max_tokens=int(rng.integers(1, 16)), ignore_eos=True,
                                temperature=0)
        engine.add(Work(str(i), prompt, params))
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
            assert book.cached_only == book.pages_held_only_by(cache.entries)
            checked += bool(book.cached_only)
    while engine.scheduler.has_work:
        engine.step()
        assert book.cached_only == book.pages_held_only_by(cache.entries)
    assert checked and engine.preemptions  # the cache held pages, and pages ran short
    assert executor.free_pages() + engine.scheduler.cached_pages == executor.total_pages
