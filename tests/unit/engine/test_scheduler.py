"""The scheduler, and the engine loop around it, without TVM: a fake executor
(tests/support/fake_executor.py) keeps a paged KV cache's books and derives its
logits from each sequence's whole content, so a scheduling mistake shows up
as a wrong token or a miscounted page."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_executor import FakeExecutor, expected_greedy
from lockgate.engine import Engine, EngineOptions, RequestHandle, Work
from lockgate.engine.params import SamplingParams
from lockgate.engine.scheduler import Scheduler
from lockgate.engine.state import RequestState
from lockgate.errors import Overloaded
from lockgate.models.tokenizer import load_tokenizer

#: the fake's vocabulary: inside the tiny model's tokenizer (299 tokens)
VOCAB = 290


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf):
    return load_tokenizer(gguf.GGUFReader(tiny_gguf))


def request_state(tokenizer, prompt, *, n=1, max_tokens=4, request_id="r") -> RequestState:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=0)
    handle = RequestHandle(None, Work(request_id, list(prompt), params), max_tokens)
    return RequestState(handle, tokenizer)


def scheduler_for(
    executor: FakeExecutor, *, budget: int | None = None, max_queue: int = 16, prefix_cache: bool = False
) -> Scheduler:
    return Scheduler(
        executor, step_token_budget=budget or executor.prefill_chunk_size, max_queue=max_queue,
        prefix_cache=prefix_cache,
    )


def empty(scheduler: Scheduler) -> None:
    """Take every request out and evict every cached sequence, through the
    scheduler's own paths (what is left is a leak)."""
    for state in [*scheduler.waiting, *scheduler.running]:
        scheduler.remove(state)
    while scheduler._evict_one() is not None:
        pass


def apply(executor: FakeExecutor, scheduler: Scheduler, batch) -> None:
    """Run a planned batch on the executor as the engine does: decode rows,
    prefill chunks, a fork once a prompt is in, one greedy token per choice
    whose tokens are all in."""
    ready = []
    if batch.decode:
        logits = executor.decode([c.seq_id for c in batch.decode], [c.pending()[0] for c in batch.decode])
        for row, choice in enumerate(batch.decode):
            scheduler.advance(choice, 1)
            ready.append((choice, logits[row]))
    if batch.prefill:
        logits = executor.prefill([c.seq_id for c, _ in batch.prefill], [t for _, t in batch.prefill])
        for row, (choice, tokens) in enumerate(batch.prefill):
            scheduler.advance(choice, len(tokens))
            if not choice.pending():
                ready.append((choice, logits[row]))
    for choice, row in ready:
        state = choice.request
        targets = [choice]
        if not state.forked:  # the prompt is in: every choice samples from its row
            scheduler.fork(state)
            targets = state.live_choices
        for each in targets:
            each.output_ids.append(int(row.argmax()))


# ------------------------------------------------------------------ admission


def test_admission_is_first_come_first_served_within_the_sequence_slots(tokenizer):
    executor = FakeExecutor(max_num_seqs=4)
    scheduler = scheduler_for(executor)
    states = [request_state(tokenizer, [5, 6], n=n, request_id=str(i)) for i, n in enumerate([2, 1, 2, 1])]
    for state in states:
        scheduler.enqueue(state)
    scheduler.admit()
    # 2 + 1 slots taken; the next asks for 2 of the 1 left, and the one after
    # it waits too rather than overtake
    assert scheduler.running == states[:2]
    assert list(scheduler.waiting) == states[2:]
    assert set(executor.tokens) == {c.seq_id for s in states[:2] for c in s.choices}


def test_a_full_queue_is_overloaded(tokenizer):
    scheduler = scheduler_for(FakeExecutor(), max_queue=2)
    scheduler.enqueue(request_state(tokenizer, [1]))
    scheduler.enqueue(request_state(tokenizer, [1]))
    with pytest.raises(Overloaded) as refused:
        scheduler.enqueue(request_state(tokenizer, [1]))
    assert refused.value.headers["Retry-After"] == "1"
    assert len(scheduler.waiting) == 2


# ------------------------------------------------------------------ planning


def test_long_prompts_are_chunked_within_the_step_budget_and_decodes_come_first(tokenizer):
    executor = FakeExecutor(prefill_chunk_size=16)
    scheduler = scheduler_for(executor, budget=10)
    short = request_state(tokenizer, [7, 8, 9], request_id="short")
    long = request_state(tokenizer, list(range(1, 26)), request_id="long")
    scheduler.enqueue(short)
    scheduler.enqueue(long)
    scheduler.admit()
    batch = scheduler.plan()
    assert batch.decode == []
    assert [(c.request.request_id, len(t)) for c, t in batch.prefill] == [("short", 3), ("long", 7)]
    apply(executor, scheduler, batch)
    batch = scheduler.plan()
    # the short prompt decodes now: 1 token of the budget, 9 left for the long one
    assert [c.request.request_id for c in batch.decode] == ["short"]
    assert [(c.request.request_id, len(t)) for c, t in batch.prefill] == [("long", 9)]
    apply(executor, scheduler, batch)
    batch = scheduler.plan()
    assert [(c.request.request_id, t) for c, t in batch.prefill] == [("long", list(range(17, 26)))]


def test_running_out_of_pages_preempts_the_newest_request(tokenizer):
    # 6 pages of 4 tokens; two 8-token prompts take 2 pages each; two
    # sequence slots, so a third request waits
    executor = FakeExecutor(total_pages=6, page_size=4, prefill_chunk_size=32, max_num_seqs=2)
    scheduler = scheduler_for(executor)
    old, new, later = (
        request_state(tokenizer, list(range(1, 9)), max_tokens=12, request_id=i) for i in ("old", "new", "later")
    )
    for state in (old, new, later):
        scheduler.enqueue(state)
    scheduler.admit()
    assert list(scheduler.waiting) == [later]
    preempted_at = None
    for step in range(12):
        batch = scheduler.plan()
        if preempted_at is None and scheduler.preemptions:
            preempted_at = step
            # it goes back first in line, ahead of the request that never ran
            assert scheduler.running == [old] and list(scheduler.waiting) == [new, later]
            assert new.choices[0].seq_id == -1 and new.choices[0].kv_len == 0
            assert new.preemptions == 1
            # what it generated stays: recomputing takes prompt and output
            assert new.choices[0].pending() == new.prompt_ids + new.choices[0].output_ids
        apply(executor, scheduler, batch)
    assert preempted_at is not None
    assert executor.free_pages() + len({p for pages in executor.pages.values() for p in pages}) == 6


def test_a_fork_shares_full_pages_and_copies_the_partly_filled_one(tokenizer):
    executor = FakeExecutor(page_size=4)
    scheduler = scheduler_for(executor)
    state = request_state(tokenizer, list(range(1, 7)), n=3)  # 6 tokens: 1 full page, 1 partial
    scheduler.enqueue(state)
    scheduler.admit()
    apply(executor, scheduler, scheduler.plan())
    assert len(state.choices) == 3 and state.forked
    used = executor.total_pages - executor.free_pages()
    assert used == 2 + 2  # the prompt's two pages, one copy per child
    parent = executor.pages[state.choices[0].seq_id]
    for child in state.choices[1:]:
        pages = executor.pages[child.seq_id]
        assert pages[0] == parent[0] and pages[1] != parent[1]
    # the admission rule's bound holds: never more than pages_alone
    assert used <= scheduler.pages_alone(6, 1, 3)


def test_removing_a_request_returns_every_page(tokenizer):
    executor = FakeExecutor(page_size=4)
    scheduler = scheduler_for(executor)
    states = [request_state(tokenizer, list(range(1, 10)), n=2, request_id=str(i)) for i in range(3)]
    for state in states:
        scheduler.enqueue(state)
    scheduler.admit()
    for _ in range(3):
        apply(executor, scheduler, scheduler.plan())
    scheduler.remove(states[1])
    assert states[1] not in scheduler.running
    assert all(c.seq_id == -1 for c in states[1].choices)
    assert scheduler.running == [states[0], states[2]]
    empty(scheduler)
    assert executor.free_pages() == executor.total_pages and not executor.tokens


# ------------------------------------------------------------------ the engine loop, driven by hand


def engine_on(executor: FakeExecutor, tokenizer, *, prefix_cache: bool = False, **options) -> Engine:
    return Engine(
        executor, tokenizer, eos_token_ids=[tokenizer.eos_token_id],
        context_length=executor.max_sequence_length,
        options=EngineOptions(prefix_cache=prefix_cache, **options),
    )


def run_to_completion(engine: Engine, limit: int = 10_000) -> None:
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        assert steps < limit, "the engine made no progress"


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_engine_retires_every_request_through_one_path(tokenizer, prefix_cache):
    executor = FakeExecutor(total_pages=8, page_size=4, prefill_chunk_size=8)
    engine = engine_on(executor, tokenizer, prefix_cache=prefix_cache)
    finished = []
    engine.observer.request_finished = lambda **kw: finished.append(kw["outcome"])
    handles = [
        engine.add(Work(str(i), [i + 1] * 6, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)))
        for i in range(4)
    ]
    engine.step()
    engine.abort(handles[3])
    run_to_completion(engine)
    assert sorted(finished) == ["aborted", "success", "success", "success"]
    # what is not free is held by the prefix cache alone, and can be emptied
    assert executor.free_pages() + engine.scheduler.cached_pages == executor.total_pages
    empty(engine.scheduler)
    assert executor.free_pages() == executor.total_pages and not executor.tokens


TOKENS = st.integers(3, VOCAB - 1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prefixes=st.lists(st.lists(TOKENS, max_size=30), min_size=3, max_size=3),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),  # which shared prefix its prompt starts with
            st.lists(TOKENS, min_size=1, max_size=12),  # the rest of its prompt
            st.one_of(st.none(), st.integers(0, 7)),  # the earlier request it follows up
            st.integers(1, 3),  # n
            st.integers(0, 12),  # max_tokens (0: the prompt's logprobs alone)
            st.integers(0, 6),  # steps before it arrives
            st.booleans(),  # whether it asks for its prompt's logprobs
        ),
        min_size=1,
        max_size=8,
    ),
    total_pages=st.integers(14, 40),
    budget=st.integers(1, 24),
    prefix_cache=st.booleans(),
    logprob_rows=st.integers(1, 9),
)
def test_any_schedule_generates_exactly_what_each_request_would_alone(
    tokenizer, prefixes, requests, total_pages, budget, prefix_cache, logprob_rows
):
    """Whatever arrives when, however small the step budget and the cache,
    with preemptions, forks and prefix-cache hits (prompts share prefixes; a
    follow-up resends an earlier prompt and its answer, as a chat turn
    does): each choice's tokens are those greedy decoding of its prompt
    gives on its own, prompt logprobs are those of each prefix's logits
    (however few rows a step may return), the scheduler's page book agrees
    with the executor after every step, and every page comes back (the
    cached ones once the cache is emptied)."""
    executor = FakeExecutor(
        vocab_size=VOCAB, page_size=4, total_pages=total_pages, max_num_seqs=4,
        prefill_chunk_size=16, max_sequence_length=64,
    )
    engine = engine_on(executor, tokenizer, prefix_cache=prefix_cache, max_num_batched_tokens=budget, max_n=3)
    engine.scheduler.prompt_logprob_rows = logprob_rows
    prompts: dict[int, list[int]] = {}
    for i, (prefix, rest, follows, _, max_tokens, _, _) in enumerate(requests):
        if follows is not None and follows < i:
            earlier = prompts[follows]
            prompts[i] = earlier + expected_greedy(executor, earlier, requests[follows][4]) + rest
        else:
            prompts[i] = prefixes[prefix] + rest
    added = []
    pending = sorted(range(len(requests)), key=lambda i: requests[i][5])
    step = 0
    while pending or engine.scheduler.has_work:
        while pending and requests[pending[0]][5] <= step:
            i = pending.pop(0)
            prompt, n, max_tokens = prompts[i][:60], requests[i][3], requests[i][4]
            params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                    prompt_logprobs=2 if requests[i][6] else None)
            try:
                engine.add(Work(str(i), prompt, params))
            except Exception as exc:  # too big for this cache or context even alone: refused up front
                assert "KV pages" in str(exc) or "context length" in str(exc)
                continue
            added.append((engine.scheduler.waiting[-1], prompt, n, max_tokens))
        engine.step()
        assert engine.scheduler.book.free == executor.free_pages()
        step += 1
        assert step < 5_000
    for state, prompt, n, max_tokens in added:
        assert state.done and len(state.choices) == n
        want = expected_greedy(executor, prompt, max_tokens)
        for choice in state.choices:
            assert choice.output_ids == want
        assert state.handle.usage.cached_tokens <= len(prompt) - 1
        if not prefix_cache or state.params.prompt_logprobs is not None:
            assert state.handle.usage.cached_tokens == 0
        if state.params.prompt_logprobs is not None:
            assert state.prompt_logprobs[0] is None and len(state.prompt_logprobs) == len(prompt)
            for q, entry in enumerate(state.prompt_logprobs[1:], 1):
                row = executor._logits(prompt[:q]).astype(np.float64)
                logprobs = row - row.max() - np.log(np.exp(row - row.max()).sum())
                assert entry.token_id == prompt[q]
                assert entry.logprob == pytest.approx(logprobs[prompt[q]], abs=1e-5)
                assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:2])
                assert entry.rank == 1 + np.count_nonzero(row > row[prompt[q]])
        else:
            assert state.prompt_logprobs is None
    assert executor.free_pages() + engine.scheduler.cached_pages == executor.total_pages
    empty(engine.scheduler)
    assert executor.free_pages() == executor.total_pages and not executor.tokens


# ------------------------------------------------------------------ the prefix cache


def prefilled(executor: FakeExecutor, since: int) -> int:
    """Prompt tokens the executor prefilled in its calls from `since` on."""
    return sum(sum(rows.values()) for kind, rows in executor.calls[since:] if kind == "prefill")


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=0)


def test_a_shared_prefix_is_forked_not_prefilled_even_mid_page(tokenizer):
    executor = FakeExecutor(page_size=4, total_pages=64, prefill_chunk_size=16)
    engine = engine_on(executor, tokenizer, prefix_cache=True)
    first = list(range(10, 30))  # 20 tokens
    handle = engine.add(Work("a", first, greedy(4)))
    run_to_completion(engine)
    assert handle.usage.cached_tokens == 0
    answer = expected_greedy(executor, first, 4)

    # 18 tokens in common: 4 full pages shared, the fifth copied
    calls = len(executor.calls)
    shared = engine.add(Work("b", first[:18] + [200, 201], greedy(3)))
    run_to_completion(engine)
    assert shared.usage.cached_tokens == 18
    assert prefilled(executor, calls) == 2

    # the next turn of a chat: the whole first prompt and its answer are in
    # the cache (but the answer's last token, which never went in)
    calls = len(executor.calls)
    turn = first + answer + [202, 203, 204]
    follow_up = engine.add(Work("c", turn, greedy(3)))
    state = engine.scheduler.waiting[-1]
    run_to_completion(engine)
    assert follow_up.usage.cached_tokens == len(first) + len(answer) - 1
    assert prefilled(executor, calls) == 4
    assert state.choices[0].output_ids == expected_greedy(executor, turn, 3)
    assert engine.scheduler.book.free == executor.free_pages()


def test_without_the_cache_everything_is_prefilled(tokenizer):
    executor = FakeExecutor(page_size=4, total_pages=64, prefill_chunk_size=16)
    engine = engine_on(executor, tokenizer, prefix_cache=False)
    first = list(range(10, 30))
    engine.add(Work("a", first, greedy(4)))
    run_to_completion(engine)
    calls = len(executor.calls)
    again = engine.add(Work("b", first, greedy(3)))
    run_to_completion(engine)
    assert again.usage.cached_tokens == 0 and prefilled(executor, calls) == 20
    assert executor.free_pages() == executor.total_pages


def test_a_full_cache_is_evicted_before_anything_waits_or_is_preempted(tokenizer):
    """A stream of distinct long prompts through a small cache: the oldest
    cached sequences make room, nothing fails or is preempted, and the cache
    never holds more pages than the pool has."""
    executor = FakeExecutor(page_size=4, total_pages=20, prefill_chunk_size=16, max_sequence_length=64)
    engine = engine_on(executor, tokenizer, prefix_cache=True)
    finished = []
    engine.observer.request_finished = lambda **kw: finished.append(kw["outcome"])
    for i in range(30):
        prompt = [3 + (i * 7 + j) % (VOCAB - 3) for j in range(40)]
        engine.add(Work(str(i), prompt, greedy(8)))
        run_to_completion(engine)
        assert engine.scheduler.cached_pages <= executor.total_pages - executor.free_pages()
        assert engine.scheduler.book.free == executor.free_pages()
    assert finished == ["success"] * 30
    assert engine.preemptions == 0
    assert 0 < len(engine.scheduler.cache.entries) <= 2  # 12 pages each, of 20
    assert executor.free_pages() + engine.scheduler.cached_pages == executor.total_pages


def test_the_least_recently_used_prefix_is_evicted_first(tokenizer):
    executor = FakeExecutor(page_size=4, total_pages=16, prefill_chunk_size=16, max_sequence_length=64)
    engine = engine_on(executor, tokenizer, prefix_cache=True)
    a, b = [5] * 16, [6] * 16
    for prompt in (a, b):
        engine.add(Work("x", prompt, greedy(1)))
        run_to_completion(engine)
    engine.add(Work("a again", a + [7], greedy(1)))  # a is now the more recently used
    run_to_completion(engine)
    engine.add(Work("big", [8] * 30, greedy(1)))  # needs pages: one cached sequence goes
    run_to_completion(engine)
    survivors = [entry.tokens[:16].tolist() for entry in engine.scheduler.cache.entries.values()]
    assert a in survivors and b not in survivors


def test_forks_aborts_and_preemptions_with_cached_prefixes_leak_no_page(tokenizer):
    executor = FakeExecutor(page_size=4, total_pages=17, prefill_chunk_size=16, max_num_seqs=6)
    engine = engine_on(executor, tokenizer, prefix_cache=True, max_n=3)
    system = list(range(40, 60))
    engine.add(Work("warm", system + [1], greedy(2)))
    run_to_completion(engine)
    handles = [engine.add(Work(str(i), system + [i + 3], greedy(10, n=3))) for i in range(3)]
    engine.step()
    engine.abort(handles[1])
    run_to_completion(engine)
    assert all(h.usage.cached_tokens == len(system) for h in handles)
    assert engine.preemptions > 0  # two requests' 6 choices outgrow 17 pages
    assert engine.scheduler.book.free == executor.free_pages()
    assert executor.free_pages() + engine.scheduler.cached_pages == executor.total_pages
    empty(engine.scheduler)
    assert executor.free_pages() == executor.total_pages


def test_a_burst_with_one_system_prompt_prefills_it_once(tokenizer):
    """Requests that arrive together with one long shared prefix: the first
    prefills it, the others wait the few steps that takes and fork from it."""
    executor = FakeExecutor(page_size=4, total_pages=64, prefill_chunk_size=16, max_sequence_length=128)
    engine = engine_on(executor, tokenizer, prefix_cache=True, max_num_batched_tokens=16)
    system = list(range(100, 140))  # 40 tokens: three steps of prefill at 16 a step
    handles = [engine.add(Work(str(i), system + [200 + i], greedy(2))) for i in range(3)]
    states = list(engine.scheduler.waiting)
    run_to_completion(engine)
    assert [h.usage.cached_tokens for h in handles] == [0, 40, 40]
    assert prefilled(executor, 0) == 41  # the others' last prompt token goes in as a decode row
    for state, handle in zip(states, handles):
        prompt = system + [200 + int(handle.request_id)]
        assert state.choices[0].output_ids == expected_greedy(executor, prompt, 2)


def test_without_the_cache_a_burst_is_not_held_back(tokenizer):
    executor = FakeExecutor(page_size=4, total_pages=64, prefill_chunk_size=16, max_sequence_length=128)
    engine = engine_on(executor, tokenizer, prefix_cache=False, max_num_batched_tokens=48)
    for i in range(3):
        engine.add(Work(str(i), list(range(100, 140)) + [200 + i], greedy(2)))
    engine.step()
    assert len(engine.scheduler.running) == 3
