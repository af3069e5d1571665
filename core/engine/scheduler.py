"""The scheduler: which requests run, what each engine step computes, and
where the KV pages go.

Continuous batching: requests are admitted first come, first served while
there are sequence slots and KV pages for their first prompt chunk. Each step
decodes every running sequence in one batch and fills the rest of the step's
token budget with prefill chunks of admitted prompts. When KV pages run out,
the most recently admitted request is preempted: its pages are freed and it
goes back to the head of the queue, to be recomputed (prompt plus what it had
generated) when pages are free again. Its output is unaffected.

With the prefix cache on, a choice's sequence is not removed when it
finishes: it stays in the KV cache, indexed by its tokens, and a sequence
admitted later forks from the longest prefix of its own tokens that a cached
or running sequence holds, and prefills only the rest. Cached sequences are
evicted, least recently used first, whenever pages are short: before a
request waits for admission, before a running one is preempted, before a
fork lacks the page it copies. A full cache therefore never holds back a
request that would have run without it.

The scheduler is the only code that creates, forks and removes KV sequences,
and every token that enters the KV cache is counted through `advance`, so
page accounting has one home (`PageBook`). It touches the executor only
through that part of its interface (`add_sequence`, `fork_sequence`,
`remove_sequence`, `free_pages` and the sizes), and it is not thread-safe:
the engine calls it under its lock.

A request that asks for its prompt's logprobs needs every prompt position's
logits: its prompt is prefilled in chunks of at most `prompt_logprob_rows`
positions a step (all such chunks of a step together), and never taken from
the prefix cache, so the logprobs are computed, the same whether or not the
prefix was cached.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable

import structlog

from lockgate.engine.prefix_cache import PageBook, PrefixCache, PrefixMatch, common_prefix
from lockgate.engine.speculation import DraftContext, SpeculationPolicy
from lockgate.engine.state import Choice, RequestState
from lockgate.errors import Overloaded

log = structlog.get_logger("lockgate.engine")

#: most logits (rows times vocabulary) one step's prefill returns for prompt
#: logprobs: 64 MiB of float32, 341 prompt positions a step at a vocabulary
#: of 49,152, 128 at Llama 3's 128,256
PROMPT_LOGPROB_LOGITS = 1 << 24


#: a decode row's draft tokens and the name of the drafter that proposed them
Drafts = tuple[list[int], str | None]


@dataclasses.dataclass
class Batch:
    """What one engine step runs: decode rows, then prefill chunks."""

    decode: list[Choice]
    prefill: list[tuple[Choice, list[int]]]
    #: per decode row, the tokens drafted to verify after it (and their
    #: drafter's name); empty when the step does not speculate
    drafts: list[Drafts] = dataclasses.field(default_factory=list)
    #: per decode row, what the drafters proposed (of which `drafts` verifies
    #: the first k); empty where nothing was asked
    proposed: list[Drafts] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """Admission, step planning, preemption and KV page accounting.

    :param kv: the executor (its sequence and page methods and sizes).
    :param step_token_budget: tokens one step may carry, decode rows and
        prefill chunks together.
    :param max_queue: requests that may wait for admission.
    :param on_preempt: called on each preemption (for metrics).
    :param prefix_cache: keep finished sequences' KV for later requests to fork from.
    :param on_prefix_lookup: called with (tokens looked up, tokens found) on
        each prefix-cache lookup (for metrics).
    """

    def __init__(
        self,
        kv,
        *,
        step_token_budget: int,
        max_queue: int,
        retry_after: int = 1,
        on_preempt: Callable[[], None] = lambda: None,
        prefix_cache: bool = True,
        on_prefix_lookup: Callable[[int, int], None] = lambda tokens, found: None,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        self.kv = kv
        self.speculation = speculation
        self.on_preempt = on_preempt
        self.on_prefix_lookup = on_prefix_lookup
        self.book = PageBook(kv.page_size, kv.total_pages)
        self.cache = PrefixCache(kv.page_size) if prefix_cache else None
        self.step_token_budget = step_token_budget
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.preemptions = 0
        self._seq_ids = itertools.count()
        #: prompt positions whose logits one step may return for prompt logprobs
        self.prompt_logprob_rows = max(1, PROMPT_LOGPROB_LOGITS // kv.vocab_size)

    # ------------------------------------------------------------ arithmetic

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.kv.page_size)

    def pages_alone(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Pages a request needs at its longest, running alone: children share
        the prompt's pages (+1 each: a fork copies the partly filled last page)."""
        return self.pages(prompt_len + max_tokens) + (n - 1) * (self.pages(max_tokens) + 1)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ admission

    def enqueue(self, state: RequestState) -> None:
        """Queue a request for admission; `Overloaded` (429) when the queue is full."""
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(
                f"the server is busy: {len(self.waiting)} requests are waiting; retry later",
                retry_after=self.retry_after,
            )
        self.waiting.append(state)

    def admit(self) -> None:
        """FCFS admission while sequence slots and pages for the next prompt
        chunk last (evicting cached sequences for those pages if need be)."""
        slots = sum(s.slots for s in self.running)
        free = self.kv.free_pages() - slots  # one page of headroom per running sequence
        while self.waiting:
            state = self.waiting[0]
            if slots + state.slots > self.kv.max_num_seqs:
                break
            if self._prefix_on_its_way(state):
                break
            first_chunk = min(len(state.prompt_ids), self.step_token_budget)
            need = self.pages(first_chunk) * (len(state.live_choices) if state.forked else 1)
            while need > free and (freed := self._evict_one()) is not None:
                free += freed
            if need > free and self.running:
                break
            self.waiting.popleft()
            for choice in state.live_choices:
                self._place(choice)
            self.running.append(state)
            slots += state.slots
            free -= need

    def _prefix_on_its_way(self, state: RequestState) -> bool:
        """Whether a running request is still prefilling a prefix of this
        one's prompt that is longer than any the cache holds: admitted now,
        it would compute that prefix a second time; a step or two later, it
        forks from it (a burst of requests with one system prompt)."""
        if self.cache is None or state.preemptions or not self.running or state.computes_whole_prompt:
            return False
        tokens = state.prompt_array
        cached = self.cache.longest_prefix(tokens, len(tokens) - 1)
        have = 0 if cached is None else cached.length
        limit = len(tokens) - 1
        for other in self.running:
            first = other.choices[0]
            if first.kv_len >= len(other.prompt_ids):
                continue  # its prompt is in: a fork can share it now
            # it must share more than this many tokens: one comparison
            # rules most out before the whole prompts are compared
            need = max(have, first.kv_len, self.kv.page_size - 1)
            held = other.prompt_array
            if need >= min(limit, len(held)) or held[need] != tokens[need]:
                continue
            common = common_prefix(held, tokens, limit)
            if common >= self.kv.page_size and common > max(have, first.kv_len):
                return True
        return False

    def _place(self, choice: Choice) -> None:
        """Give an admitted choice its KV sequence: forked from the longest
        prefix of its tokens the KV cache holds, else empty."""
        tokens = choice.tokens()
        # prompt logprobs and pooled positions are computed, never read from a cached prefix
        match = None if choice.request.computes_whole_prompt else self._longest_prefix(tokens)
        choice.seq_id = next(self._seq_ids)
        if match is None:
            self.kv.add_sequence(choice.seq_id)
            self.book.add(choice.seq_id)
            choice.kv_len = 0
        else:
            self.kv.fork_sequence(match.seq_id, choice.seq_id, match.length)
            self.book.fork(match.seq_id, choice.seq_id, match.length)
            choice.kv_len = match.length
        state = choice.request
        if choice.index == 0 and state.preemptions == 0:
            state.handle.usage.cached_tokens = choice.kv_len

    def _longest_prefix(self, tokens: list[int]) -> PrefixMatch | None:
        if self.cache is None:
            return None
        # at least the last token is computed: its logits are what comes next
        running = (
            (state.choices[0].seq_id, state.prompt_array[: state.choices[0].kv_len])
            for state in self.running
            if state.choices[0].seq_id >= 0
        )
        match = self.cache.longest_prefix(tokens, len(tokens) - 1, running)
        self.on_prefix_lookup(len(tokens), 0 if match is None else match.length)
        if match is not None and match.length % self.kv.page_size and not self._ensure_free(1, keep=match.seq_id):
            return None  # no page for the fork's copy of the partly filled page
        return match

    # ------------------------------------------------------------ planning

    def plan(self) -> Batch:
        """This step's decode rows and prefill chunks within the token budget
        and the free pages, preempting the newest requests if pages run out."""
        page_size = self.kv.page_size
        while True:
            budget = self.step_token_budget
            decode: list[Choice] = []
            prefill: list[tuple[Choice, list[int]]] = []
            chunks_wanted: list[Choice] = []
            pages = 0
            for state in self.running:
                for choice in state.choices:
                    if choice.finished:
                        continue
                    pending = choice.pending_count()
                    if pending == 1 and state.pooler is None:  # a pooled prompt is never decoded
                        decode.append(choice)
                        # the token opens a page when the last one is full
                        pages += choice.kv_len % page_size == 0
                        if not state.forked:
                            pages += state.params.n - 1  # a one-token prompt forks here
                    elif pending:
                        chunks_wanted.append(choice)
            budget -= len(decode)
            chunk_room = self.kv.prefill_chunk_size
            logprob_rows = self.prompt_logprob_rows
            for choice in chunks_wanted:
                if budget <= 0 or chunk_room <= 0:
                    break
                pending_tokens = choice.pending()
                take = min(len(pending_tokens), budget, chunk_room)
                if choice.request.wants_prompt_logprobs:
                    take = min(take, logprob_rows)
                    if take == 0:
                        continue
                    logprob_rows -= take
                prefill.append((choice, pending_tokens[:take]))
                pages += self.pages(choice.kv_len + take) - self.pages(choice.kv_len)
                if take == len(pending_tokens) and not choice.request.forked:
                    pages += choice.request.params.n - 1  # forked children copy the last page
                budget -= take
                chunk_room -= take
            if pages <= self.kv.free_pages() or not self.running:
                drafts, proposed = self._drafts(decode, budget, self.kv.free_pages() - pages)
                return Batch(decode, prefill, drafts, proposed)
            if self._evict_one() is None:
                self.preempt(self.running[-1])

    def _drafts(self, decode: list[Choice], budget: int, spare_pages: int) -> tuple[list[Drafts], list[Drafts]]:
        """Tokens to verify after each decode row, within what the step has
        left of its token budget and of the free pages: none for a batch too
        large to pay for them, for a choice still reading its prompt, or
        where the drafters propose nothing; as many of those proposed as
        the policy finds worth verifying (`SpeculationPolicy.choose`); and
        what was proposed."""
        policy = self.speculation
        if policy is None or not decode or not policy.worthwhile(len(decode)):
            return [], []
        proposed: list[Drafts] = []
        # the drafts go in one prefill call with every row
        room = self.kv.prefill_chunk_size - len(decode)
        for choice in decode:
            state = choice.request
            k = min(policy.most, budget, room,
                    state.max_tokens - len(choice.output_ids) - 1,
                    self.kv.max_sequence_length - choice.kv_len - 1)
            tokens, drafter = [], None
            if state.forked and choice.kv_len >= len(state.prompt_ids) and k > 0:
                context = DraftContext(state.prompt_ids, choice.output_ids, state.params.prediction, choice.matcher)
                tokens, drafter = policy.draft(context, k)
                # a page more only where the drafts cross into one
                while tokens and self.pages(choice.kv_len + 1 + len(tokens)) - self.pages(choice.kv_len + 1) > spare_pages:
                    tokens.pop()
                spare_pages -= self.pages(choice.kv_len + 1 + len(tokens)) - self.pages(choice.kv_len + 1)
                budget -= len(tokens)
                room -= len(tokens)
            proposed.append((tokens, drafter if tokens else None))
        k = policy.choose(proposed, [choice.request.drafts.acceptance for choice in decode])
        return ([(tokens[:k], drafter) for tokens, drafter in proposed] if k else []), proposed

    def preempt(self, state: RequestState) -> None:
        """Give up a request's KV and queue it first, to be recomputed later.

        With the prefix cache on, its sequences go to the cache as the most
        recently used: older cached sequences are evicted first, and what
        survives of its own comes back as a prefix when it is readmitted.
        """
        self.running.remove(state)
        for choice in state.choices:
            self._keep_or_free(choice)
            choice.kv_len = 0
        if state.pooler is not None:
            state.pooler.reset()  # its prompt is computed again from the start
        state.preemptions += 1
        self.preemptions += 1
        self.on_preempt()
        self.waiting.appendleft(state)
        log.info("request preempted", request_id=state.request_id, preemptions=state.preemptions)

    # ------------------------------------------------------------ sequences

    def advance(self, choice: Choice, tokens: int) -> None:
        """`tokens` more of the choice's tokens are in the KV cache."""
        choice.kv_len += tokens
        self.book.grow(choice.seq_id, choice.kv_len)

    def hold_drafts(self, choice: Choice, drafts: int) -> None:
        """A speculative step appended `drafts` tokens past the choice's
        `kv_len`: held until `settle` keeps the accepted ones."""
        choice.kv_held = choice.kv_len + drafts
        self.book.grow(choice.seq_id, choice.kv_held)

    def settle(self, choice: Choice) -> None:
        """Drop the drafts a speculative step did not accept: the sequence
        holds its `kv_len` tokens again, as if they had never been appended."""
        held, choice.kv_held = choice.kv_held, None
        if held is None or held == choice.kv_len or choice.seq_id < 0:
            return
        self.kv.truncate(choice.seq_id, choice.kv_len)
        self.book.truncate(choice.seq_id, choice.kv_len)

    def fork(self, state: RequestState) -> None:
        """The prompt is in: add the request's other choices, sharing its KV."""
        parent = state.choices[0]
        for child in state.new_choices():
            if parent.kv_len % self.kv.page_size:
                self._ensure_free(1)  # the child copies the partly filled last page
            child.seq_id = next(self._seq_ids)
            self.kv.fork_sequence(parent.seq_id, child.seq_id)
            self.book.fork(parent.seq_id, child.seq_id, parent.kv_len)
            child.kv_len = parent.kv_len
            state.choices.append(child)
        state.forked = True

    def finish_choice(self, choice: Choice) -> None:
        """A choice is done: its sequence goes to the prefix cache, or its
        pages back to the pool."""
        choice.finished = True
        self.settle(choice)
        if self.speculation is not None:
            self.speculation.learn(choice.tokens())
        self._keep_or_free(choice)

    def _keep_or_free(self, choice: Choice) -> None:
        """Hand a choice's sequence to the prefix cache (when on, and the
        sequence fills a page at least), else remove it."""
        if choice.seq_id < 0:
            return
        if self.cache is None or choice.kv_len < self.kv.page_size:
            self._free([choice])
            return
        for redundant in self.cache.insert(choice.seq_id, choice.tokens()[: choice.kv_len]):
            self._remove_sequence(redundant)
        if choice.seq_id in self.cache.entries:
            self.book.mark_cached(choice.seq_id)
        choice.seq_id = -1  # the cache holds it now

    def remove(self, state: RequestState) -> None:
        """Take a request out of the queues and free every page it holds."""
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self._free(state.choices)

    @property
    def cached_pages(self) -> int:
        """Pages only cached sequences hold (what evicting them all would free)."""
        return 0 if self.cache is None else self.book.cached_only

    @property
    def cached_sequences(self) -> int:
        """Sequences the prefix cache holds: at most one per KV page, each
        holding at least a page, so its size is bounded by the KV cache's."""
        return 0 if self.cache is None else len(self.cache.entries)

    # ------------------------------------------------------------ freeing pages

    def _ensure_free(self, pages: int, *, keep: int | None = None) -> bool:
        """Evict cached sequences (but `keep`) until `pages` are free; whether they are."""
        while self.kv.free_pages() < pages:
            if self._evict_one(keep=keep) is None:
                return False
        return True

    def _evict_one(self, *, keep: int | None = None) -> int | None:
        """Evict the least recently used cached sequence (but `keep`): the
        pages that freed (none, where running sequences share them all), or
        None when there is nothing to evict."""
        seq_id = None if self.cache is None else self.cache.least_recently_used(keep=keep)
        if seq_id is None:
            return None
        self.cache.discard(seq_id)
        return self._remove_sequence(seq_id)

    def _remove_sequence(self, seq_id: int) -> int:
        try:
            self.kv.remove_sequence(seq_id)
        except Exception:
            log.exception("removing a sequence failed", seq_id=seq_id)
        return self.book.remove(seq_id)

    def _free(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.seq_id >= 0:
                self._remove_sequence(choice.seq_id)
                choice.seq_id = -1
