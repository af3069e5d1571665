"""The scheduler: which requests run, what each engine step computes, and
where the KV pages go.

Continuous batching: requests are admitted first come, first served while
there are sequence slots and KV pages for their first prompt chunk. Each step
decodes every running sequence in one batch and fills the rest of the step's
token budget with prefill chunks of admitted prompts. When KV pages run out,
the most recently admitted request is preempted: its pages are freed and it
goes back to the head of the queue, to be recomputed (prompt plus what it had
generated) when pages are free again. Its output is unaffected.

The scheduler is the only code that creates, forks and removes KV sequences,
so page accounting has one home. It touches the executor only through that
part of its interface (`add_sequence`, `fork_sequence`, `remove_sequence`,
`free_pages` and the sizes), and it is not thread-safe: the engine calls it
under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable

import structlog

from lockgate.engine.state import Choice, RequestState
from lockgate.errors import Overloaded

log = structlog.get_logger("lockgate.engine")


@dataclasses.dataclass
class Batch:
    """What one engine step runs: decode rows, then prefill chunks."""

    decode: list[Choice]
    prefill: list[tuple[Choice, list[int]]]

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """Admission, step planning, preemption and KV page accounting.

    :param kv: the executor (its sequence and page methods and sizes).
    :param step_token_budget: tokens one step may carry, decode rows and
        prefill chunks together.
    :param max_queue: requests that may wait for admission.
    :param on_preempt: called on each preemption (for metrics).
    """

    def __init__(
        self,
        kv,
        *,
        step_token_budget: int,
        max_queue: int,
        retry_after: int = 1,
        on_preempt: Callable[[], None] = lambda: None,
    ) -> None:
        self.kv = kv
        self.on_preempt = on_preempt
        self.step_token_budget = step_token_budget
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.preemptions = 0
        self._seq_ids = itertools.count()

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
        """FCFS admission while sequence slots and pages for the next prompt chunk last."""
        slots = sum(s.slots for s in self.running)
        free = self.kv.free_pages() - slots  # one page of headroom per running sequence
        while self.waiting:
            state = self.waiting[0]
            if slots + state.slots > self.kv.max_num_seqs:
                break
            first_chunk = min(len(state.prompt_ids), self.step_token_budget)
            need = self.pages(first_chunk) * (len(state.live_choices) if state.forked else 1)
            if need > free and self.running:
                break
            self.waiting.popleft()
            for choice in state.live_choices:
                choice.seq_id = next(self._seq_ids)
                self.kv.add_sequence(choice.seq_id)
            self.running.append(state)
            slots += state.slots
            free -= need

    # ------------------------------------------------------------ planning

    def plan(self) -> Batch:
        """This step's decode rows and prefill chunks within the token budget
        and the free pages, preempting the newest requests if pages run out."""
        while True:
            budget = self.step_token_budget
            decode: list[Choice] = []
            prefill: list[tuple[Choice, list[int]]] = []
            pages = 0
            for state in self.running:
                for choice in state.live_choices:
                    if len(choice.pending()) == 1:
                        decode.append(choice)
                        pages += self.pages(choice.kv_len + 1) - self.pages(choice.kv_len)
                        if not state.forked:
                            pages += state.params.n - 1  # a one-token prompt forks here
            budget -= len(decode)
            chunk_room = self.kv.prefill_chunk_size
            for state in self.running:
                for choice in state.live_choices:
                    pending = choice.pending()
                    if len(pending) <= 1 or budget <= 0 or chunk_room <= 0:
                        continue
                    take = min(len(pending), budget, chunk_room)
                    prefill.append((choice, pending[:take]))
                    pages += self.pages(choice.kv_len + take) - self.pages(choice.kv_len)
                    if take == len(pending) and not state.forked:
                        pages += state.params.n - 1  # forked children copy the last page
                    budget -= take
                    chunk_room -= take
            if pages <= self.kv.free_pages() or not self.running:
                return Batch(decode, prefill)
            self.preempt(self.running[-1])

    def preempt(self, state: RequestState) -> None:
        """Free a request's KV and queue it first, to be recomputed later."""
        self.running.remove(state)
        self._free(state.choices)
        for choice in state.choices:
            choice.kv_len = 0
        state.preemptions += 1
        self.preemptions += 1
        self.on_preempt()
        self.waiting.appendleft(state)
        log.info("request preempted", request_id=state.request_id, preemptions=state.preemptions)

    # ------------------------------------------------------------ sequences

    def fork(self, state: RequestState) -> None:
        """The prompt is in: add the request's other choices, sharing its KV."""
        parent = state.choices[0]
        for child in state.new_choices():
            child.seq_id = next(self._seq_ids)
            self.kv.fork_sequence(parent.seq_id, child.seq_id)
            child.kv_len = parent.kv_len
            state.choices.append(child)
        state.forked = True

    def finish_choice(self, choice: Choice) -> None:
        """A choice is done: its pages go back to the pool."""
        choice.finished = True
        self._free([choice])

    def remove(self, state: RequestState) -> None:
        """Take a request out of the queues and free every page it holds."""
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self._free(state.choices)

    def remove_all(self) -> list[RequestState]:
        """Take every request out (shutdown, an unhealthy engine) and free its pages."""
        states = [*self.waiting, *self.running]
        for state in states:
            self.remove(state)
        return states

    def _free(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.seq_id < 0:
                continue
            try:
                self.kv.remove_sequence(choice.seq_id)
            except Exception:
                log.exception("removing a sequence failed", seq_id=choice.seq_id)
            choice.seq_id = -1
