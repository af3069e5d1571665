"""The engine loop: admits requests, runs each step's batch on the executor,
samples, applies the stop rules and streams results back to the event loop.

It runs in its own thread. `Engine.add` is called from the pipeline's worker
thread and raises typed errors when a request cannot be admitted, so the HTTP
layer can still answer with a proper status (`admission` holds the checks).
Results reach each request's `RequestHandle` on the event loop through an
`Outbox` (`delivery`), at most one hand-over per engine step.

What to run each step is the `Scheduler`'s decision; which token comes next
is the sampler's; when a choice ends is the `StopChecker`'s. This module ties
them to the executor, isolates failures (a failure tied to one request fails
that request alone) and retires every request through one path.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from lockgate.engine.admission import admitted_max_tokens
from lockgate.engine.client import EngineStats
from lockgate.engine.delivery import Events, Outbox
from lockgate.engine.executor import Executor
from lockgate.engine.handle import END, Delta, EngineObserver, RequestHandle
from lockgate.engine.options import EngineOptions
from lockgate.engine.pooling import pooled_prefill
from lockgate.engine.sampling import SamplingRow
from lockgate.engine.scheduler import Scheduler
from lockgate.engine.speculation import Drafter, SpeculationPolicy
from lockgate.engine.state import Choice, RequestState
from lockgate.engine.stop import LENGTH, StopChecker
from lockgate.engine.verification import speculative_step
from lockgate.engine.work import Work
from lockgate.errors import InternalError, Unavailable

log = structlog.get_logger("lockgate.engine")

#: consecutive failed engine steps after which the engine declares itself unhealthy
UNHEALTHY_AFTER_FAILURES = 3

#: how a request left the engine, for the observer
SUCCESS, ERROR, ABORTED = "success", "error", "aborted"


class Engine:
    """Continuous batching over one executor, in this process (an
    `EngineClient`)."""

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
        drafters: Sequence[Drafter] = (),
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.context_length = min(context_length, executor.max_sequence_length)
        self.options = options
        self.name = name
        self.observer = observer or EngineObserver()
        self.scheduler = Scheduler(
            executor,
            step_token_budget=options.max_num_batched_tokens or executor.prefill_chunk_size,
            max_queue=options.max_queue,
            retry_after=options.retry_after,
            on_preempt=lambda: self.observer.preempted(),
            # forks are what the prefix cache shares prompts through
            prefix_cache=options.prefix_cache and executor.shares_prefixes,
            on_prefix_lookup=lambda tokens, found: self.observer.prefix_lookup(tokens, found),
            speculation=SpeculationPolicy(list(drafters), options.speculative_tokens, options.speculation_max_batch)
            if options.speculation and drafters and executor.can_truncate else None,
        )
        self.stop_checker = StopChecker(eos_token_ids)
        # re-entrant: a request may be retired while the lock is already held
        self._cond = threading.Condition(threading.RLock())
        self._aborts: list[RequestHandle] = []
        # results of steps on their way to the event loop
        self._outbox = Outbox()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exit_requested = False
        self._consecutive_failures = 0
        self.unhealthy_reason: str | None = None
        # read by other threads (health, metrics) instead of asking the
        # executor, which only the engine thread may touch
        self._kv_free_pages = executor.free_pages()
        self._kv_cached_pages = 0

    @property
    def max_n(self) -> int:
        """The most choices one request may ask for (one where the executor
        cannot fork a sequence: choices share their prompt's KV through forks)."""
        if not self.executor.shares_prefixes:
            return 1
        return min(self.options.max_n, self.executor.max_num_seqs)

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    # ----------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start (or restart, after `shutdown`) the engine thread; results are
        delivered on `loop`."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._outbox.open(loop)
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
                if not self.scheduler.has_work:
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
            self._fail_all(self._shutdown_error())
        self._thread = None
        self._exit_requested = False

    def _shutdown_error(self) -> Unavailable:
        return Unavailable("the server is shutting down", retry_after=self.options.retry_after)

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self._stopping

    def stats(self) -> EngineStats:
        """Load and KV cache figures, and what the weights run as
        (`Executor.load_report`) when the executor says."""
        with self._cond:
            return EngineStats(
                requests_running=len(self.scheduler.running),
                requests_waiting=len(self.scheduler.waiting),
                kv_pages_total=self.executor.total_pages,
                # pages only the prefix cache holds are not "used": evicting
                # them is free whenever a request needs the room
                kv_pages_used=self.executor.total_pages - self._kv_free_pages - self._kv_cached_pages,
                kv_pages_cached=self._kv_cached_pages,
                prefix_cache_sequences=self.scheduler.cached_sequences,
                weights=self.executor.load_report,
                memory=self.executor.memory,
            )

    def close(self) -> None:
        """Nothing beyond the executor, which its `Model` closes."""

    # ----------------------------------------------------------- admission

    def add(self, work: Work) -> RequestHandle:
        """Queue `work` for admission, or raise why it cannot be: the 400s
        of a request that can never run (`admission`), `Overloaded` (429)
        when the queue is full, `Unavailable` (503) when unhealthy or
        shutting down."""
        if not self.healthy:
            raise Unavailable(
                "the engine is not serving: "
                + (self.unhealthy_reason or "the server is shutting down"),
                retry_after=self.options.retry_after,
            )
        max_tokens = admitted_max_tokens(self, work)
        handle = RequestHandle(self, work, max_tokens)
        state = RequestState(handle, self.tokenizer)
        with self._cond:
            if not self.healthy:
                raise Unavailable("the engine is not serving", retry_after=self.options.retry_after)
            self.scheduler.enqueue(state)
            self._cond.notify_all()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Ask the engine thread to drop `handle`'s request and free its pages."""
        with self._cond:
            self._aborts.append(handle)
            self._cond.notify_all()

    # ----------------------------------------------------------- engine thread

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(engine=self.name)
        while True:
            with self._cond:
                while not self._exit_requested and not (self.scheduler.has_work or self._aborts):
                    self._cond.wait()
                if self._exit_requested:
                    self._process_aborts()
                    self._fail_all(self._shutdown_error())
                    return
            try:
                self.step()
            except Exception:  # a bug in the engine itself: never let the thread die
                log.exception("engine step crashed")
                self._fail_all(InternalError("the engine failed"))
                self._note_failure("the engine step crashed")

    def step(self) -> None:
        """One scheduling step: aborts, admission, one decode batch, prefill chunks."""
        events: Events = []
        with self._cond:
            self._process_aborts()
            if not self._stopping:
                self.scheduler.admit()
            batch = self.scheduler.plan()
        if batch.decode and self.scheduler.speculation is not None:
            speculative_step(self, batch, events)
        elif batch.decode:
            self._run_decode(batch.decode, events)
        if batch.prefill:
            self._run_prefill(batch.prefill, events)
        self._note_pages()
        self._outbox.deliver(events)

    def _process_aborts(self) -> None:
        aborted = {id(handle) for handle in self._aborts}
        self._aborts.clear()
        if not aborted:
            return
        for state in [*self.scheduler.waiting, *self.scheduler.running]:
            if id(state.handle) in aborted:
                self._retire(state, ABORTED, None, [])

    def _run_decode(self, choices: list[Choice], events: Events) -> None:
        try:
            logits = self.executor.decode([c.seq_id for c in choices], [c.next_pending() for c in choices])
        except Exception as exc:
            self._executor_failed(exc, {c.request for c in choices}, events)
            return
        self._consecutive_failures = 0
        for choice in choices:
            self.scheduler.advance(choice, 1)
        # a one-token prompt goes in as a decode row: it may be the one to fork
        ready, rows = self._forked_when_prompt_is_in(list(enumerate(choices)), events)
        if ready:
            # no fork and no failure: the rows are the logits as they are
            self._sample(ready, logits if rows == list(range(len(logits))) else logits[rows], events)

    def _run_prefill(self, chunks: list[tuple[Choice, list[int]]], events: Events) -> None:
        chunks = pooled_prefill(self, chunks, events)  # runs the pooled requests' chunks, returns the rest
        if not chunks:
            return
        # chunks of prompts whose logprobs are asked for return every row
        every = [choice.request.wants_prompt_logprobs for choice, _ in chunks]
        try:
            seq_ids, token_ids = [c.seq_id for c, _ in chunks], [t for _, t in chunks]
            if any(every):
                logits = self.executor.prefill(seq_ids, token_ids, every)
            else:
                logits = self.executor.prefill(seq_ids, token_ids)
        except Exception as exc:
            self._executor_failed(exc, {c.request for c, _ in chunks}, events)
            return
        self._consecutive_failures = 0
        done: list[tuple[int, Choice]] = []
        row = 0
        for (choice, tokens), all_rows in zip(chunks, every):
            first_row, row = row, row + (len(tokens) if all_rows else 1)
            if all_rows:
                try:
                    choice.request.note_prompt_logprobs(choice.kv_len, logits, first_row, len(tokens))
                except Exception:
                    log.exception("prompt logprobs failed", request_id=choice.request.request_id)
                    self._retire(choice.request, ERROR, InternalError("prompt logprobs failed for this request"),
                                 events)
                    continue
            self.scheduler.advance(choice, len(tokens))
            if not choice.pending_count():  # else more of the prompt is to come
                done.append((row - 1, choice))
        ready, rows = self._forked_when_prompt_is_in(done, events)
        if ready:
            self._sample(ready, logits[rows], events)

    def _forked_when_prompt_is_in(
        self, done: list[tuple[int, Choice]], events: Events
    ) -> tuple[list[Choice], list[int]]:
        """The choices to sample from the logits rows of `done` (row, choice
        whose tokens are all in). A request whose prompt has just gone in is
        forked first: its `n` choices share the prompt's row."""
        ready: list[Choice] = []
        rows: list[int] = []
        for row, choice in done:
            state = choice.request
            if not state.forked:
                try:
                    self.scheduler.fork(state)
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

    def _sample(self, choices: list[Choice], logits: np.ndarray, events: Events) -> None:
        """Sample the next token of each choice and apply the stop rules.
        `logits` is what the executor returned, rows selected; its own
        `sample` chooses the tokens (on the device, for logits left there).

        A failure tied to one request (its grammar, its detokenization) fails
        that request alone.
        """
        rows: list[SamplingRow] = []
        sampled: list[Choice] = []
        logit_rows: list[int] = []
        for i, choice in enumerate(choices):
            state = choice.request
            if state.max_tokens == 0:
                # nothing to generate (an echo of the prompt's logprobs)
                events.append((state.handle, Delta(choice.index, "", [], LENGTH,
                                                   prompt_logprobs=state.prompt_logprobs)))
                self._finish_choice(choice, events)
                continue
            allowed = None
            if choice.matcher is not None:
                try:
                    allowed = choice.matcher.allowed(logits.shape[1])
                except Exception:
                    log.exception("grammar mask failed", request_id=choice.request.request_id)
                    self._retire(state, ERROR, InternalError("structured output failed for this request"), events)
                    continue
            params = state.params
            if len(choice.output_ids) < params.min_tokens:
                allowed = self.stop_checker.held_back(allowed, params, logits.shape[1])
            rng = None if params.greedy else choice.rng
            rows.append(SamplingRow(params, rng, state.prompt_ids, choice.output_ids, allowed))
            sampled.append(choice)
            logit_rows.append(i)
        if not sampled:
            return
        if len(logit_rows) < len(logits):
            logits = logits[logit_rows]
        tokens, logprobs = self.executor.sample(logits, rows)
        now = time.monotonic()
        for choice, token, logprob in zip(sampled, tokens.tolist(), logprobs):
            state = choice.request
            if state.done or choice.finished:
                continue
            try:
                delta = self.stop_checker.accept(choice, token, logprob)
            except Exception:
                log.exception("generation failed for one request", request_id=state.request_id)
                self._retire(state, ERROR, InternalError("generation failed for this request"), events)
                continue
            if state.first_token_at is None:
                state.first_token_at = now
            if state.prompt_logprobs is not None and len(choice.output_ids) == 1:
                delta.prompt_logprobs = state.prompt_logprobs
            events.append((state.handle, delta))
            if delta.finish_reason is not None:
                self._finish_choice(choice, events)

    def _finish_choice(self, choice: Choice, events: Events) -> None:
        self.scheduler.finish_choice(choice)
        if not choice.request.live_choices:
            self._retire(choice.request, SUCCESS, END, events)

    # ----------------------------------------------------------- retiring

    def _retire(self, state: RequestState, outcome: str, final: Any, events: Events) -> None:
        """The one way a request leaves the engine, finished, failed or
        aborted: out of the scheduler with its pages freed, `final` (`END` or
        the exception; None for an abort, which nobody reads) to its handle,
        and one report to the observer."""
        if state.done:
            return
        state.done = True
        if state.params.prediction:
            state.handle.usage.accepted_prediction_tokens = state.drafts.prediction_accepted
            state.handle.usage.rejected_prediction_tokens = state.drafts.prediction_rejected
        with self._cond:
            self.scheduler.remove(state)
        for choice in state.choices:
            choice.finished = True
        if final is not None:
            events.append((state.handle, final))
        ttft, tpot = state.latencies() if outcome == SUCCESS else (None, None)
        completion_tokens = state.completion_tokens
        self.observer.request_finished(ttft=ttft, tpot=tpot, prompt_tokens=len(state.prompt_ids),
                                       completion_tokens=completion_tokens, outcome=outcome)
        log.debug("request retired", request_id=state.request_id, outcome=outcome,
                  prompt_tokens=len(state.prompt_ids), completion_tokens=completion_tokens,
                  ttft_ms=None if ttft is None else round(ttft * 1000, 1), preemptions=state.preemptions)

    def _fail_all(self, error: Exception) -> None:
        """Fail every queued and running request with `error`."""
        events: Events = []
        with self._cond:
            for state in [*self.scheduler.waiting, *self.scheduler.running]:
                self._retire(state, ERROR, error, events)
            self._note_pages()
        self._outbox.deliver(events)

    def _note_pages(self) -> None:
        """Page counts for other threads (health, metrics), which may not ask
        the executor: only the engine thread touches it."""
        self._kv_free_pages = self.executor.free_pages()
        self._kv_cached_pages = self.scheduler.cached_pages

    # ----------------------------------------------------------- failures

    def _executor_failed(self, exc: Exception, states: set[RequestState], events: Events) -> None:
        log.error("executor call failed", error=repr(exc), request_ids=sorted(s.request_id for s in states),
                  exc_info=exc)
        for state in states:
            self._retire(state, ERROR, InternalError("the model failed while generating"), events)
        self._note_failure(f"executor failed: {exc!r}")

    def _note_failure(self, reason: str) -> None:
        self._consecutive_failures += 1
        if self._consecutive_failures >= UNHEALTHY_AFTER_FAILURES and self.unhealthy_reason is None:
            self.unhealthy_reason = f"{self._consecutive_failures} engine steps failed in a row ({reason})"
            log.error("engine is unhealthy", reason=self.unhealthy_reason)
            self._fail_all(Unavailable("the engine is unhealthy", retry_after=self.options.retry_after))
