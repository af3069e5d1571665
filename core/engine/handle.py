"""What the event loop holds of an admitted request: its handle, the deltas
it reads from it, and the token counts."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from lockgate.engine.sampling import TokenLogprob
from lockgate.engine.work import Work

if TYPE_CHECKING:
    from lockgate.engine.loop import Engine


@dataclasses.dataclass
class Delta:
    """New output of one choice, produced by one engine step."""

    #: the choice's index within its request, 0 .. n-1
    index: int
    text: str
    token_ids: list[int]
    #: None while the choice goes on; then "stop" or "length"
    finish_reason: str | None = None
    #: one entry per token in `token_ids` when the request asked for logprobs
    logprobs: list[TokenLogprob] | None = None
    #: the stop string that ended the choice (finish_reason "stop"), if one did
    stop_string: str | None = None
    #: on a choice's first delta when the request asked for prompt logprobs:
    #: one entry per prompt token, the first None (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: a pooled request's (`Work.pooling`) one delta: the pooled final
    #: hidden state, float32, not normalized
    embedding: np.ndarray | None = None


@dataclasses.dataclass
class Usage:
    """Token counts of one request (or, summed, of several)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: prompt tokens whose KV came from the prefix cache, not a prefill
    cached_tokens: int = 0
    #: with a predicted output: its tokens the output took, and those it
    #: did not (both counted in `completion_tokens` where drawn); None without one
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: "Usage") -> "Usage":
        def both(a, b):
            return None if a is None and b is None else (a or 0) + (b or 0)

        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
            both(self.accepted_prediction_tokens, other.accepted_prediction_tokens),
            both(self.rejected_prediction_tokens, other.rejected_prediction_tokens),
        )


#: put on a handle's queue after its last delta
END = object()


class RequestHandle:
    """The event loop's side of one admitted request: an async iterator of `Delta`.

    Iteration raises the exception the engine failed the request with, if any.
    `abort()` stops generation and frees the request's KV pages. A consumer
    that merges many handles may `subscribe` instead of iterating.
    """

    #: in process: no replica to name (`lockgate.engine.client.Handle`)
    replica = None

    def __init__(self, engine: "Engine", work: Work, max_tokens: int) -> None:
        self.request_id = work.request_id
        self.work = work
        #: choices this request generates
        self.n = work.params.n
        self.max_tokens = max_tokens
        self.usage = Usage(prompt_tokens=len(work.prompt_token_ids))
        self._engine = engine
        # what the engine delivered and nobody read yet; a plain deque and
        # one waiter, not an asyncio.Queue: every token passes through here
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._subscriber: Callable[[Any], None] | None = None
        self.finished = False

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> Delta:
        while not self._items:
            if self.finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._read(self._items.popleft())

    def _read(self, item: Any) -> Delta:
        if item is END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.usage.completion_tokens += len(item.token_ids)
        return item

    def subscribe(self, callback: Callable[[Delta | BaseException | None], None]) -> None:
        """Have what the engine delivers handed to `callback` as it comes,
        on the event loop, instead of iterating: each `Delta`, then None when
        the request ends or the exception it failed with. What was delivered
        before is handed over at once. Usage and `finished` are kept as
        iteration keeps them."""
        self._subscriber = callback
        while self._items and self._subscriber is callback:
            self._hand_over(self._items.popleft())

    def _hand_over(self, item: Any) -> None:
        try:
            delta = self._read(item)
        except StopAsyncIteration:
            self._subscriber(None)
        except BaseException as exc:  # noqa: BLE001 - handed over, not raised
            self._subscriber(exc)
        else:
            self._subscriber(delta)

    def abort(self) -> None:
        """Stop this request (client gone, or a sibling request failed)."""
        if not self.finished:
            self._engine.abort(self)

    def put(self, item: Any) -> None:
        """Deliver a `Delta`, `END` or an exception (on the event loop only)."""
        if self._subscriber is not None:
            self._hand_over(item)
            return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class EngineObserver:
    """Receives the engine's events (for metrics). The default does nothing;
    calls come from the engine thread."""

    def request_finished(self, *, ttft: float | None, tpot: float | None,
                         prompt_tokens: int, completion_tokens: int, outcome: str) -> None:
        pass

    def preempted(self) -> None:
        pass

    def speculated(self, drafter: str | None, drafted: int, accepted: int) -> None:
        """A speculative step verified `drafted` tokens of `drafter`'s and
        accepted `accepted` of them."""

    def prefix_lookup(self, tokens: int, found: int) -> None:
        """A sequence looked for `tokens` tokens in the prefix cache and
        found the first `found` of them."""


#: an observer call as it crosses to another process: the method's name and its keywords
ObserverEvent = tuple[str, dict[str, Any]]


class RecordingObserver(EngineObserver):
    """Keeps an engine's observer calls until they are taken, for an engine
    in another process (a Ray replica, a model's child process) whose
    front feeds them to its own observer (`replay`), so the server's
    metrics are one set."""

    def __init__(self) -> None:
        self.events: list[ObserverEvent] = []

    def request_finished(self, **fields) -> None:
        self.events.append(("request_finished", fields))

    def preempted(self) -> None:
        self.events.append(("preempted", {}))

    def speculated(self, drafter: str | None, drafted: int, accepted: int) -> None:
        self.events.append(("speculated", {"drafter": drafter, "drafted": drafted, "accepted": accepted}))

    def prefix_lookup(self, tokens: int, found: int) -> None:
        self.events.append(("prefix_lookup", {"tokens": tokens, "found": found}))

    def take(self) -> list[ObserverEvent]:
        events, self.events = self.events, []
        return events

    @staticmethod
    def replay(events: list[ObserverEvent], observer: EngineObserver) -> None:
        """Make on `observer` the calls `events` recorded."""
        for kind, fields in events:
            getattr(observer, kind)(**fields)
