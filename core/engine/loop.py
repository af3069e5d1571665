"""The engine: admits requests, batches their sequences onto the executor,
samples, detokenizes and streams results back to the event loop.

It runs in its own thread. `Engine.add` is called from the pipeline's worker
thread and raises typed errors when a request cannot be admitted, so the HTTP
layer can still answer with a proper status. Results reach each request's
`RequestHandle` through `loop.call_soon_threadsafe`, once per engine step.

Scheduling (continuous batching): requests are admitted first come, first
served while there are sequence slots and KV pages for their prompt. Each step
decodes every running sequence in one batch and fills the rest of the step's
token budget with prefill chunks of admitted prompts. When KV pages run out,
the most recently admitted request is preempted: its pages are freed and it
goes back to the head of the queue, to be recomputed (prompt plus what it had
generated) when pages are free again. Its output is unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from lockgate.engine.detokenizer import IncrementalDetokenizer
from lockgate.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequestError,
    Overloaded,
    Unavailable,
)
from lockgate.engine.sampling import SamplingRow, TokenLogprob, make_generator, sample_batch
from lockgate.engine.options import EngineOptions
from lockgate.engine.work import Work

if TYPE_CHECKING:  # the engine needs the interface only to name it
    from lockgate.models.executor import Executor

log = structlog.get_logger("lockgate.engine")

#: consecutive failed engine steps after which the engine declares itself unhealthy
UNHEALTHY_AFTER_FAILURES = 3


@dataclasses.dataclass
class Delta:
    """New output of one choice, produced by one engine step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    #: one entry per token in `token_ids` when the request asked for logprobs
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


class EngineObserver:
    """Receives the engine's events (for metrics). The default does nothing;
    calls come from the engine thread."""

    def request_finished(self, *, ttft: float | None, tpot: float | None,
                         prompt_tokens: int, completion_tokens: int, outcome: str) -> None:
        pass

    def preempted(self) -> None:
        pass


_END = object()


class RequestHandle:
    """The event loop's side of one admitted request: an async iterator of `Delta`.

    Iteration raises the exception the engine failed the request with, if any.
    `abort()` stops generation and frees the request's KV pages.
    """

    def __init__(self, engine: "Engine", work: Work, max_tokens: int) -> None:
        self.request_id = work.request_id
        self.work = work
        self.max_tokens = max_tokens
        self.usage = Usage(prompt_tokens=len(work.prompt_token_ids))
        self._engine = engine
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> Delta:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.usage.completion_tokens += len(item.token_ids)
        return item

    def abort(self) -> None:
        """Stop this request (client gone, or a sibling request failed)."""
        if not self.finished:
            self._engine.abort(self)

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class _Choice:
    """One generated sequence of a request, as the engine tracks it."""

    def __init__(self, state: "_RequestState", index: int, detokenizer) -> None:
        self.state = state
        self.index = index
        #: the executor's sequence id, or -1 while the choice holds no KV
        self.seq_id = -1
        #: tokens of prompt + output already in the KV cache
        self.kv_len = 0
        self.output_ids: list[int] = []
        self.detokenizer = detokenizer
        self.rng = make_generator(state.params, index)
        grammar = state.params.grammar
        self.matcher = None if grammar is None else grammar.matcher()
        self.finished = False

    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt's rest, or the last sampled token."""
        prompt = self.state.prompt_ids
        if self.kv_len < len(prompt):
            return [*prompt[self.kv_len :], *self.output_ids]
        return self.output_ids[self.kv_len - len(prompt) :]


class _RequestState:
    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.work = handle.work
        self.params = handle.work.params
        self.prompt_ids = handle.work.prompt_token_ids
        self.choices: list[_Choice] = []
        #: children are created by forking the first choice once the prompt is in
        self.forked = False
        self.arrived_at = time.monotonic()
        self.first_token_at: float | None = None
        self.preemptions = 0
        #: finished, failed or aborted, as the engine thread sees it
        self.done = False

    @property
    def live_choices(self) -> list[_Choice]:
        return [c for c in self.choices if not c.finished]

    @property
    def slots(self) -> int:
        """Sequence slots this request occupies (or will, once forked)."""
        return self.params.n if not self.forked else len(self.live_choices)


@dataclasses.dataclass
class _Batch:
    """What one step runs: decode rows, prefill chunks, forks, pages needed."""

    decode: list[_Choice]
    prefill: list[tuple[_Choice, list[int]]]
    pages: int


class Engine:
    """Continuous batching over one executor."""

    def __init__(
        self,
        executor: Executor,
        tokenizer,
        *,
        eos_token_ids: Sequence[int],
        context_length: int,
        options: EngineOptions = EngineOptions(),
        name: str = "engine",
        observer: EngineObserver | None = None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = min(context_length, executor.max_sequence_length)
        self.options = options
        self.name = name
        self.observer = observer or EngineObserver()
        self.step_token_budget = options.max_num_batched_tokens or executor.prefill_chunk_size
        self._cond = threading.Condition()
        self._waiting: collections.deque[_RequestState] = collections.deque()
        self._running: list[_RequestState] = []
        self._aborts: collections.deque[RequestHandle] = collections.deque()
        self._seq_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exit_requested = False
        self._consecutive_failures = 0
        self.unhealthy_reason: str | None = None
        self.preemptions = 0
        # read by other threads (health, metrics) instead of asking the
        # executor, which only the engine thread may touch
        self._kv_free_pages = executor.free_pages()

    # ----------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start (or restart, after `shutdown`) the engine thread; results are
        delivered on `loop`."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._loop = loop
        self._stopping = False
        self._kv_free_pages = self.executor.free_pages()
        self._thread = threading.Thread(target=self._run, name=f"lockgate-{self.name}", daemon=True)
        self._thread.start()

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`,
        then fail what is left with 503 and stop the thread.

        The engine thread itself fails the leftovers: the executor is only
        ever touched from that thread.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline:
            with self._cond:
                if not self._running and not self._waiting:
                    break
            time.sleep(0.05)
        with self._cond:
            thread = self._thread
            self._exit_requested = True
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=60)
            if thread.is_alive():
                log.error("the engine thread did not stop within 60 s")
        else:
            with self._cond:
                self._fail_all(self._shutdown_error())
                self._kv_free_pages = self.executor.free_pages()
        self._thread = None
        self._exit_requested = False

    def _shutdown_error(self) -> Unavailable:
        return Unavailable("the server is shutting down", retry_after=self.options.retry_after)

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self._stopping

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "requests_running": len(self._running),
                "requests_waiting": len(self._waiting),
                "kv_pages_total": self.executor.total_pages,
                "kv_pages_used": self.executor.total_pages - self._kv_free_pages,
            }

    # ----------------------------------------------------------- admission

    def add(self, work: Work) -> RequestHandle:
        """Queue `work` for admission, or raise why it cannot be.

        Raises `ContextLengthExceeded` / `InvalidRequestError` (400) for a
        request that can never run, `Overloaded` (429) when the queue is
        full, `Unavailable` (503) when unhealthy or shutting down.
        """
        if not self.healthy:
            raise Unavailable(
                "the engine is not serving: "
                + (self.unhealthy_reason or "the server is shutting down"),
                retry_after=self.options.retry_after,
            )
        params = work.params
        prompt_len = len(work.prompt_token_ids)
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_n = min(self.options.max_n, self.executor.max_num_seqs)
        if params.n > max_n:
            raise InvalidRequestError(f"n must be at most {max_n}", param="n")
        if prompt_len >= self.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, your prompt is {prompt_len} tokens, which leaves no room "
                "for a completion. Please reduce the length of the prompt.",
                param=work.prompt_param,
            )
        max_tokens = self.context_length - prompt_len if params.max_tokens is None else params.max_tokens
        if prompt_len + max_tokens > self.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens "
                f"({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        for token in itertools.chain(work.prompt_token_ids, params.logit_bias, params.stop_token_ids):
            if not 0 <= token < self.executor.vocab_size:
                raise InvalidRequestError(
                    f"token id {token} is outside the vocabulary (0..{self.executor.vocab_size - 1})",
                    param="prompt",
                )
        pages = self._pages_alone(prompt_len, max_tokens, params.n)
        if pages > self.executor.total_pages:
            raise InvalidRequestError(
                f"the request needs {pages} KV pages with n={params.n}, more than the "
                f"server's {self.executor.total_pages}; lower n or max_tokens",
                param="n",
            )
        handle = RequestHandle(self, work, max_tokens)
        with self._cond:
            if not self.healthy:
                raise Unavailable("the engine is not serving", retry_after=self.options.retry_after)
            if len(self._waiting) >= self.options.max_queue:
                raise Overloaded(
                    f"the server is busy: {len(self._waiting)} requests are waiting; retry later",
                    retry_after=self.options.retry_after,
                )
            self._waiting.append(_RequestState(handle))
            self._cond.notify_all()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Ask the engine thread to drop `handle`'s request and free its pages."""
        with self._cond:
            self._aborts.append(handle)
            self._cond.notify_all()

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.executor.page_size)

    def _pages_alone(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Pages a request needs at its longest, running alone: children share
        the prompt's pages (+1 each: a fork copies the partly filled last page)."""
        return self._pages(prompt_len + max_tokens) + (n - 1) * (self._pages(max_tokens) + 1)

    # ----------------------------------------------------------- engine thread

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(engine=self.name)
        while True:
            with self._cond:
                while not self._exit_requested and not (
                    self._waiting or self._running or self._aborts
                ):
                    self._cond.wait()
                if self._exit_requested:
                    self._process_aborts()
                    self._fail_all(self._shutdown_error())
                    self._kv_free_pages = self.executor.free_pages()
                    return
            try:
                self.step()
            except Exception:  # a bug in the engine itself: never let the thread die
                log.exception("engine step crashed")
                with self._cond:
                    self._fail_all(InternalError("the engine failed"))
                    self._kv_free_pages = self.executor.free_pages()
                self._note_failure("the engine step crashed")

    def step(self) -> None:
        """One scheduling step: aborts, admission, one decode batch, prefill chunks."""
        events: list[tuple[RequestHandle, Any]] = []
        with self._cond:
            self._process_aborts()
            self._admit()
            batch = self._plan()
        if batch.decode:
            self._run_decode(batch.decode, events)
        if batch.prefill:
            self._run_prefill(batch.prefill, events)
        self._kv_free_pages = self.executor.free_pages()
        self._deliver(events)

    def _process_aborts(self) -> None:
        while self._aborts:
            handle = self._aborts.popleft()
            for queue in (self._waiting, self._running):
                for state in list(queue):
                    if state.handle is handle:
                        queue.remove(state)
                        self._release(state)
                        state.done = True
                        self.observer.request_finished(
                            ttft=None, tpot=None, prompt_tokens=len(state.prompt_ids),
                            completion_tokens=sum(len(c.output_ids) for c in state.choices),
                            outcome="aborted",
                        )

    def _admit(self) -> None:
        """FCFS admission while sequence slots and pages for the next prompt chunk last."""
        if self._stopping:
            return
        slots = sum(s.slots for s in self._running)
        free = self.executor.free_pages() - slots  # one page of headroom per running sequence
        while self._waiting:
            state = self._waiting[0]
            if slots + state.slots > self.executor.max_num_seqs:
                break
            first_chunk = min(len(state.prompt_ids), self.step_token_budget)
            need = self._pages(first_chunk) * max(1, len(state.live_choices) if state.forked else 1)
            if need > free and self._running:
                break
            self._waiting.popleft()
            if not state.choices:
                state.choices.append(self._new_choice(state, 0))
            for choice in state.live_choices:
                choice.seq_id = next(self._seq_ids)
                self.executor.add_sequence(choice.seq_id)
            self._running.append(state)
            slots += state.slots
            free -= need

    def _new_choice(self, state: _RequestState, index: int) -> _Choice:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            state.prompt_ids,
            stop=state.params.stop,
            skip_special_tokens=state.params.skip_special_tokens,
        )
        return _Choice(state, index, detokenizer)

    def _plan(self) -> _Batch:
        """Choose this step's decode rows and prefill chunks within the token
        budget and the free pages, preempting the newest requests if pages
        run out."""
        while True:
            budget = self.step_token_budget
            decode: list[_Choice] = []
            prefill: list[tuple[_Choice, list[int]]] = []
            pages = 0
            for state in self._running:
                for choice in state.live_choices:
                    pending = choice.pending()
                    if len(pending) == 1:
                        decode.append(choice)
                        pages += self._pages(choice.kv_len + 1) - self._pages(choice.kv_len)
                        if not state.forked:
                            pages += state.params.n - 1  # a one-token prompt forks here
            budget -= len(decode)
            chunk_room = self.executor.prefill_chunk_size
            for state in self._running:
                for choice in state.live_choices:
                    pending = choice.pending()
                    if len(pending) <= 1 or budget <= 0 or chunk_room <= 0:
                        continue
                    take = min(len(pending), budget, chunk_room)
                    prefill.append((choice, pending[:take]))
                    pages += self._pages(choice.kv_len + take) - self._pages(choice.kv_len)
                    if take == len(pending) and not state.forked:
                        pages += (state.params.n - 1)  # forked children copy the last page
                    budget -= take
                    chunk_room -= take
            if pages <= self.executor.free_pages() or not self._running:
                return _Batch(decode, prefill, pages)
            self._preempt(self._running[-1])

    def _preempt(self, state: _RequestState) -> None:
        """Free a request's KV and queue it first, to be recomputed later."""
        self._running.remove(state)
        for choice in state.choices:
            if choice.seq_id >= 0:
                self.executor.remove_sequence(choice.seq_id)
                choice.seq_id = -1
            choice.kv_len = 0
        state.preemptions += 1
        self.preemptions += 1
        self.observer.preempted()
        self._waiting.appendleft(state)
        log.info("request preempted", request_id=state.work.request_id, preemptions=state.preemptions)

    def _release(self, state: _RequestState) -> None:
        """Remove a request's sequences from the KV cache."""
        for choice in state.choices:
            if choice.seq_id >= 0:
                try:
                    self.executor.remove_sequence(choice.seq_id)
                except Exception:
                    log.exception("removing a sequence failed", seq_id=choice.seq_id)
                choice.seq_id = -1

    def _run_decode(self, choices: list[_Choice], events: list) -> None:
        try:
            logits = self.executor.decode([c.seq_id for c in choices], [c.pending()[0] for c in choices])
        except Exception as exc:
            self._executor_failed(exc, {c.state for c in choices}, events)
            return
        self._consecutive_failures = 0
        for choice in choices:
            choice.kv_len += 1
        # a one-token prompt goes in as a decode row: it may be the one to fork
        ready, rows = self._forked_when_prompt_is_in(list(enumerate(choices)), events)
        if ready:
            self._sample(ready, logits[rows], events)

    def _run_prefill(self, chunks: list[tuple[_Choice, list[int]]], events: list) -> None:
        try:
            logits = self.executor.prefill([c.seq_id for c, _ in chunks], [t for _, t in chunks])
        except Exception as exc:
            self._executor_failed(exc, {c.state for c, _ in chunks}, events)
            return
        self._consecutive_failures = 0
        done: list[tuple[int, _Choice]] = []
        for row, (choice, tokens) in enumerate(chunks):
            choice.kv_len += len(tokens)
            if not choice.pending():  # else more of the prompt is to come
                done.append((row, choice))
        ready, rows = self._forked_when_prompt_is_in(done, events)
        if ready:
            self._sample(ready, logits[rows], events)

    def _forked_when_prompt_is_in(
        self, done: list[tuple[int, _Choice]], events: list
    ) -> tuple[list[_Choice], list[int]]:
        """The choices to sample from the logits rows of `done` (row, choice
        whose tokens are all in). A request whose prompt has just gone in is
        forked first: its `n` choices share the prompt's row."""
        ready: list[_Choice] = []
        rows: list[int] = []
        for row, choice in done:
            state = choice.state
            if not state.forked:
                try:
                    self._fork(state)
                except Exception as exc:
                    self._executor_failed(exc, {state}, events)
                    continue
                for child in state.live_choices:
                    ready.append(child)
                    rows.append(row)
            else:
                ready.append(choice)
                rows.append(row)
        return ready, rows

    def _fork(self, state: _RequestState) -> None:
        """The prompt is in: create the other `n - 1` choices sharing its KV."""
        parent = state.choices[0]
        for index in range(1, state.params.n):
            child = self._new_choice(state, index)
            child.seq_id = next(self._seq_ids)
            self.executor.fork_sequence(parent.seq_id, child.seq_id)
            child.kv_len = parent.kv_len
            state.choices.append(child)
        state.forked = True

    def _sample(self, choices: list[_Choice], logits: np.ndarray, events: list) -> None:
        """Sample the next token of each choice, detokenize, check stop rules.

        A failure tied to one request (its grammar, its detokenization) fails
        that request alone.
        """
        rows: list[SamplingRow] = []
        sampled: list[_Choice] = []
        logit_rows: list[int] = []
        for i, choice in enumerate(choices):
            allowed = None
            if choice.matcher is not None:
                try:
                    allowed = choice.matcher.allowed(logits.shape[1])
                except Exception:
                    log.exception("grammar mask failed", request_id=choice.state.work.request_id)
                    self._fail_request(
                        choice.state, InternalError("structured output failed for this request"), events
                    )
                    continue
            rows.append(
                SamplingRow(choice.state.params, choice.rng, choice.state.prompt_ids, choice.output_ids, allowed)
            )
            sampled.append(choice)
            logit_rows.append(i)
        if not sampled:
            return
        tokens, logprobs = sample_batch(logits[logit_rows], rows)
        now = time.monotonic()
        for choice, token, logprob in zip(sampled, tokens, logprobs):
            state = choice.state
            if state.done or choice.finished:
                continue
            try:
                delta = self._accept(choice, int(token), logprob)
            except Exception:
                log.exception("generation failed for one request", request_id=state.work.request_id)
                self._fail_request(state, InternalError("generation failed for this request"), events)
                continue
            if state.first_token_at is None:
                state.first_token_at = now
            events.append((state.handle, delta))
            if delta.finish_reason is not None:
                self._finish_choice(choice, events)

    def _accept(self, choice: _Choice, token: int, logprob: TokenLogprob | None) -> Delta:
        params = choice.state.params
        choice.output_ids.append(token)
        index = choice.state.work.choice_offset + choice.index
        logprobs = None if logprob is None else [logprob]
        if choice.matcher is not None:
            choice.matcher.accept(token)
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            return Delta(index, choice.detokenizer.finish(), [token], "stop", logprobs)
        step = choice.detokenizer.add(token)
        if step.stopped:
            return Delta(index, step.text, [token], "stop", logprobs)
        if choice.matcher is not None and choice.matcher.is_finished:
            return Delta(index, step.text + choice.detokenizer.finish(), [token], "stop", logprobs)
        if len(choice.output_ids) >= choice.state.handle.max_tokens:
            return Delta(index, step.text + choice.detokenizer.finish(), [token], "length", logprobs)
        return Delta(index, step.text, [token], None, logprobs)

    def _finish_choice(self, choice: _Choice, events: list) -> None:
        state = choice.state
        choice.finished = True
        if choice.seq_id >= 0:
            self.executor.remove_sequence(choice.seq_id)
            choice.seq_id = -1
        if state.live_choices:
            return
        state.done = True
        with self._cond:
            if state in self._running:
                self._running.remove(state)
        events.append((state.handle, _END))
        completion_tokens = sum(len(c.output_ids) for c in state.choices)
        now = time.monotonic()
        ttft = None if state.first_token_at is None else state.first_token_at - state.arrived_at
        tpot = None
        if state.first_token_at is not None and completion_tokens > len(state.choices):
            tpot = (now - state.first_token_at) / (completion_tokens - len(state.choices))
        self.observer.request_finished(
            ttft=ttft, tpot=tpot, prompt_tokens=len(state.prompt_ids),
            completion_tokens=completion_tokens, outcome="success",
        )
        log.debug(
            "request finished",
            request_id=state.work.request_id,
            prompt_tokens=len(state.prompt_ids),
            completion_tokens=completion_tokens,
            ttft_ms=None if ttft is None else round(ttft * 1000, 1),
            preemptions=state.preemptions,
        )

    # ----------------------------------------------------------- failures

    def _executor_failed(self, exc: Exception, states: set[_RequestState], events: list) -> None:
        log.error(
            "executor call failed",
            error=repr(exc),
            request_ids=sorted(s.work.request_id for s in states),
            exc_info=exc,
        )
        for state in states:
            self._fail_request(state, InternalError("the model failed while generating"), events)
        self._note_failure(f"executor failed: {exc!r}")

    def _note_failure(self, reason: str) -> None:
        self._consecutive_failures += 1
        if self._consecutive_failures >= UNHEALTHY_AFTER_FAILURES and self.unhealthy_reason is None:
            self.unhealthy_reason = f"{self._consecutive_failures} engine steps failed in a row ({reason})"
            log.error("engine is unhealthy", reason=self.unhealthy_reason)
            with self._cond:
                self._fail_all(Unavailable("the engine is unhealthy", retry_after=self.options.retry_after))

    def _fail_request(self, state: _RequestState, error: Exception, events: list) -> None:
        if state.done:
            return
        state.done = True
        with self._cond:
            if state in self._running:
                self._running.remove(state)
            self._release(state)
        for choice in state.choices:
            choice.finished = True
        events.append((state.handle, error))
        self.observer.request_finished(
            ttft=None, tpot=None, prompt_tokens=len(state.prompt_ids),
            completion_tokens=sum(len(c.output_ids) for c in state.choices), outcome="error",
        )

    def _fail_all(self, error: Exception) -> None:
        """Fail every queued and running request (caller holds the lock)."""
        events = []
        states = [*self._waiting, *self._running]
        self._waiting.clear()
        self._running.clear()
        for state in states:
            self._release(state)
            state.done = True
            for choice in state.choices:
                choice.finished = True
            events.append((state.handle, error))
        self._deliver(events)

    def _deliver(self, events: list[tuple[RequestHandle, Any]]) -> None:
        if not events or self._loop is None:
            return

        def deliver() -> None:
            for handle, item in events:
                handle._put(item)

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
