"""The engine: admits requests, batches their sequences onto the executor,
samples, detokenizes and streams results back to the event loop.

It runs in its own thread. `Engine.add` is called from the pipeline's worker
thread and raises typed errors when a request cannot be admitted, so the HTTP
layer can still answer with a proper status. Results reach each request's
`RequestHandle` through `loop.call_soon_threadsafe`, once per engine step.
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
from typing import Any

import numpy as np
import structlog

from lockgate.detokenizer import IncrementalDetokenizer
from lockgate.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequestError,
    Overloaded,
    Unavailable,
)
from lockgate.executor import Executor
from lockgate.sampling import make_generator, sample_token
from lockgate.types import Work

log = structlog.get_logger("lockgate.engine")

#: consecutive failed executor calls after which the engine declares itself unhealthy
UNHEALTHY_AFTER_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Limits of the engine, from the CLI or environment."""

    #: requests waiting for admission before new ones get 429
    max_queue: int = 256
    #: most choices (`n`) one request may ask for
    max_n: int = 8
    #: seconds a client is told to wait on 429 / 503
    retry_after: int = 1


@dataclasses.dataclass
class Delta:
    """New output of one choice, produced by one engine step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


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
        if item.token_ids:
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

    def __init__(self, state: "_RequestState", index: int, seq_id: int, detokenizer) -> None:
        self.state = state
        self.index = index
        self.seq_id = seq_id
        self.output_ids: list[int] = []
        self.detokenizer = detokenizer
        self.rng = make_generator(state.params, index)
        #: the last sampled token, fed to the next decode step
        self.next_input: int | None = None
        self.finished = False


class _RequestState:
    def __init__(self, handle: RequestHandle, pages: int) -> None:
        self.handle = handle
        self.work = handle.work
        self.params = handle.work.params
        self.prompt_ids = handle.work.prompt_token_ids
        self.reserved_pages = pages
        self.prefilled = 0
        self.choices: list[_Choice] = []
        self.admitted_at = 0.0
        self.first_token_at: float | None = None

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids)

    @property
    def parent(self) -> _Choice:
        return self.choices[0]


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
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = min(context_length, executor.max_sequence_length)
        self.options = options
        self.name = name
        self._cond = threading.Condition()
        self._waiting: collections.deque[_RequestState] = collections.deque()
        self._running: list[_RequestState] = []
        self._aborts: collections.deque[RequestHandle] = collections.deque()
        self._reserved_pages = 0
        self._seq_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exit_requested = False
        self._consecutive_failures = 0
        self.unhealthy_reason: str | None = None

    # ----------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start (or restart, after `shutdown`) the engine thread; results are
        delivered on `loop`."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._loop = loop
        self._stopping = False
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
                "kv_pages_used": self.executor.total_pages - self.executor.free_pages(),
            }

    # ----------------------------------------------------------- admission

    def add(self, work: Work) -> RequestHandle:
        """Admit `work` to the waiting queue, or raise why it cannot be.

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
        if params.n > min(self.options.max_n, self.executor.max_num_seqs):
            raise InvalidRequestError(
                f"n must be at most {min(self.options.max_n, self.executor.max_num_seqs)}",
                param="n",
            )
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
        pages = self._pages_needed(prompt_len, max_tokens, params.n)
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
            self._waiting.append(_RequestState(handle, pages))
            self._cond.notify_all()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Ask the engine thread to drop `handle`'s request and free its pages."""
        with self._cond:
            self._aborts.append(handle)
            self._cond.notify_all()

    def _pages_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        page = self.executor.page_size
        # children fork the prompt's KV; each then needs room for its own output
        # (+1 page: a fork copies the parent's partly filled last page)
        return math.ceil((prompt_len + max_tokens) / page) + (n - 1) * (math.ceil(max_tokens / page) + 1)

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
                    return
            try:
                self.step()
            except Exception:  # a bug in the engine itself: never let the thread die
                log.exception("engine step crashed")
                with self._cond:
                    self._fail_all(InternalError("the engine failed"))
                self._note_failure("the engine step crashed")

    def step(self) -> None:
        """One scheduling step: aborts, admission, one decode batch, one prefill batch."""
        events: list[tuple[RequestHandle, Any]] = []
        with self._cond:
            self._process_aborts()
            admitted = self._admit()
        for state in admitted:
            state.admitted_at = time.monotonic()
        self._decode(events)
        self._prefill(events)
        self._deliver(events)

    def _process_aborts(self) -> None:
        while self._aborts:
            handle = self._aborts.popleft()
            for queue in (self._waiting, self._running):
                for state in list(queue):
                    if state.handle is handle:
                        queue.remove(state)
                        self._release(state)
            handle.finished = True

    def _admit(self) -> list[_RequestState]:
        admitted = []
        if self._stopping:
            return admitted
        running_seqs = sum(len(s.choices) for s in self._running)
        while self._waiting:
            state = self._waiting[0]
            n = state.params.n
            if running_seqs + n > self.executor.max_num_seqs:
                break
            if self._reserved_pages + state.reserved_pages > self.executor.total_pages:
                break
            self._waiting.popleft()
            self._reserved_pages += state.reserved_pages
            seq_id = next(self._seq_ids)
            self.executor.add_sequence(seq_id)
            state.choices.append(self._new_choice(state, 0, seq_id))
            self._running.append(state)
            running_seqs += n
            admitted.append(state)
        return admitted

    def _new_choice(self, state: _RequestState, index: int, seq_id: int) -> _Choice:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            state.prompt_ids,
            stop=state.params.stop,
            skip_special_tokens=state.params.skip_special_tokens,
        )
        return _Choice(state, index, seq_id, detokenizer)

    def _release(self, state: _RequestState) -> None:
        """Remove a request's sequences from the KV cache and its page reservation."""
        for choice in state.choices:
            if choice.seq_id >= 0:
                try:
                    self.executor.remove_sequence(choice.seq_id)
                except Exception:
                    log.exception("removing a sequence failed", seq_id=choice.seq_id)
                choice.seq_id = -1
        self._reserved_pages -= state.reserved_pages
        state.reserved_pages = 0

    def _decode(self, events: list) -> None:
        with self._cond:
            choices = [
                c
                for state in self._running
                for c in state.choices
                if not c.finished and c.next_input is not None
            ]
        if not choices:
            return
        try:
            logits = self.executor.decode([c.seq_id for c in choices], [c.next_input for c in choices])
        except Exception as exc:
            self._executor_failed(exc, {c.state for c in choices}, events)
            return
        self._consecutive_failures = 0
        for row, choice in zip(logits, choices):
            self._advance(choice, row, events)

    def _prefill(self, events: list) -> None:
        budget = self.executor.prefill_chunk_size
        batch: list[tuple[_RequestState, int, int]] = []
        with self._cond:
            for state in self._running:
                if state.prefill_done or budget <= 0:
                    continue
                take = min(len(state.prompt_ids) - state.prefilled, budget)
                batch.append((state, state.prefilled, state.prefilled + take))
                budget -= take
        if not batch:
            return
        try:
            logits = self.executor.prefill(
                [state.parent.seq_id for state, _, _ in batch],
                [state.prompt_ids[start:end] for state, start, end in batch],
            )
        except Exception as exc:
            self._executor_failed(exc, {state for state, _, _ in batch}, events)
            return
        self._consecutive_failures = 0
        for (state, _, end), row in zip(batch, logits):
            state.prefilled = end
            if not state.prefill_done:
                continue
            try:
                for index in range(1, state.params.n):
                    seq_id = next(self._seq_ids)
                    self.executor.fork_sequence(state.parent.seq_id, seq_id)
                    state.choices.append(self._new_choice(state, index, seq_id))
            except Exception as exc:
                self._executor_failed(exc, {state}, events)
                continue
            for choice in list(state.choices):
                self._advance(choice, row, events)

    def _advance(self, choice: _Choice, logits: np.ndarray, events: list) -> None:
        """Sample the next token of one choice, detokenize it, check the stop rules."""
        state = choice.state
        if state.handle.finished:
            return
        try:
            token = sample_token(logits, state.params, choice.rng, state.prompt_ids, choice.output_ids)
            delta = self._accept(choice, token)
        except Exception:
            log.exception("generation failed for one request", request_id=state.work.request_id)
            self._fail_request(state, InternalError("generation failed for this request"), events)
            return
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
        events.append((state.handle, delta))
        if delta.finish_reason is not None:
            choice.finished = True
            self._finish_choice(choice, events)

    def _accept(self, choice: _Choice, token: int) -> Delta:
        params = choice.state.params
        choice.output_ids.append(token)
        choice.next_input = token
        index = choice.state.work.choice_offset + choice.index
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            return Delta(index, choice.detokenizer.finish(), [token], "stop")
        step = choice.detokenizer.add(token)
        if step.stopped:
            return Delta(index, step.text, [token], "stop")
        if len(choice.output_ids) >= choice.state.handle.max_tokens:
            return Delta(index, step.text + choice.detokenizer.finish(), [token], "length")
        return Delta(index, step.text, [token], None)

    def _finish_choice(self, choice: _Choice, events: list) -> None:
        state = choice.state
        if choice.seq_id >= 0:
            self.executor.remove_sequence(choice.seq_id)
            choice.seq_id = -1
        if all(c.finished for c in state.choices) and len(state.choices) == state.params.n:
            with self._cond:
                if state in self._running:
                    self._running.remove(state)
                self._release(state)
            events.append((state.handle, _END))
            log.info(
                "request finished",
                request_id=state.work.request_id,
                prompt_tokens=len(state.prompt_ids),
                completion_tokens=sum(len(c.output_ids) for c in state.choices),
                ttft_ms=None
                if state.first_token_at is None
                else round((state.first_token_at - state.admitted_at) * 1000, 1),
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
        with self._cond:
            if state in self._running:
                self._running.remove(state)
            self._release(state)
        for choice in state.choices:
            choice.finished = True
        events.append((state.handle, error))

    def _fail_all(self, error: Exception) -> None:
        """Fail every queued and running request (caller holds the lock)."""
        events = []
        states = [*self._waiting, *self._running]
        self._waiting.clear()
        self._running.clear()
        for state in states:
            self._release(state)
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

