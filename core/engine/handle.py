"""What the event loop holds of an admitted request: its handle, the deltas
it reads from it, and the token counts."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

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


@dataclasses.dataclass
class Usage:
    """Token counts of one request (or, summed, of several)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: prompt tokens whose KV came from the prefix cache, not a prefill
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )


#: put on a handle's queue after its last delta
END = object()


class RequestHandle:
    """The event loop's side of one admitted request: an async iterator of `Delta`.

    Iteration raises the exception the engine failed the request with, if any.
    `abort()` stops generation and frees the request's KV pages.
    """

    def __init__(self, engine: "Engine", work: Work, max_tokens: int) -> None:
        self.request_id = work.request_id
        self.work = work
        #: choices this request generates
        self.n = work.params.n
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
        if item is END:
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

    def put(self, item: Any) -> None:
        """Deliver a `Delta`, `END` or an exception (on the event loop only)."""
        self._queue.put_nowait(item)


class EngineObserver:
    """Receives the engine's events (for metrics). The default does nothing;
    calls come from the engine thread."""

    def request_finished(self, *, ttft: float | None, tpot: float | None,
                         prompt_tokens: int, completion_tokens: int, outcome: str) -> None:
        pass

    def preempted(self) -> None:
        pass

    def prefix_lookup(self, tokens: int, found: int) -> None:
        """A sequence looked for `tokens` tokens in the prefix cache and
        found the first `found` of them."""
