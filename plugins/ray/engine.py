"""The front's engine when the engines run on Ray Serve: `RayEngine` is an
`EngineClient` (`lockgate.engine.client`) that sends each request's work to
a replica.

`add` runs in the pipeline's worker thread, like `Engine.add`, and returns
only once a replica admitted the work or refused it, so a refusal (context
length, overload, unavailable) is raised before the response starts, as
from a local engine. The deltas then stream back through a
`RemoteRequestHandle`, a `Handle` like the local `RequestHandle`.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import structlog

from lockgate.engine import Delta, EngineObserver, EngineStats, Usage, Work
from lockgate.engine.client import IteratedHandle
from lockgate.engine.handle import RecordingObserver
from lockgate.errors import Overloaded, Unavailable
from lockgate.engine.wire import ADMISSION_TIMEOUT, Admitted, Failed, Finished, to_wire
from lockgate.plugins.ray.affinity import prefix_hashes

log = structlog.get_logger("lockgate.ray")

#: replicas tried for one request when the one chosen dies before answering
ADMISSION_ATTEMPTS = 3


class ReplicaLost(Unavailable):
    """The replica serving a request stopped (its process died) (503)."""

    code = "replica_lost"


class RayEngine:
    """Engine replicas on Ray Serve, seen from the front: an `EngineClient`."""

    def __init__(self, name: str, deployment, board, *, retry_after: int, prefix_affinity: bool,
                 description: dict[str, Any], on_close=None) -> None:
        self.name = name
        self.context_length: int = description["context_length"]
        self.max_n: int = description["max_n"]
        self.observer = EngineObserver()
        self._deployment = deployment
        self._board = board
        self._retry_after = retry_after
        self._prefix_affinity = prefix_affinity
        self._replicas: dict[str, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._stopping = False
        self._on_close = on_close

    # ----------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopping = False
        self._reader = loop.create_task(self._read_board_forever())

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting; the replicas themselves are taken down by whoever
        deployed them (`lockgate.plugins.ray.serve_on_ray`'s closer)."""
        self._stopping = True
        if self._reader is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._reader.cancel)

    def close(self) -> None:
        """Take the replicas down (and Ray, where this process started it)."""
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    @property
    def healthy(self) -> bool:
        return not self._stopping and any(f.get("healthy") for f in self._replicas.values())

    @property
    def unhealthy_reason(self) -> str | None:
        if self._stopping:
            return "the server is shutting down"
        if not self.healthy:
            return "no engine replica is serving"
        return None

    def stats(self) -> EngineStats:
        """The engines' figures summed over the replicas, and each replica's
        (with its health, pid and admitted count) under `replicas`."""
        return EngineStats.summed({replica: EngineStats.from_dict(f) for replica, f in self._replicas.items()})

    async def _read_board_forever(self) -> None:
        from lockgate.plugins.ray.board import POST_EVERY

        while True:
            try:
                self._replicas, events = await self._board.read.remote()
                RecordingObserver.replay(events, self.observer)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("cannot read the replica board", exc_info=True)
            await asyncio.sleep(POST_EVERY)

    # ----------------------------------------------------------- admission

    def add(self, work: Work) -> "RemoteRequestHandle":
        """Send `work` to a replica; returns once it is admitted. Raises what
        the replica's engine raised, `Overloaded` when every replica is full,
        `Unavailable` when none serves."""
        if self._stopping or self._loop is None:
            raise Unavailable("the server is shutting down", retry_after=self._retry_after)
        future = asyncio.run_coroutine_threadsafe(self._submit(work), self._loop)
        try:
            return future.result(ADMISSION_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise Unavailable(
                f"no engine replica took the request within {ADMISSION_TIMEOUT:g} s",
                retry_after=self._retry_after,
            ) from None

    async def _submit(self, work: Work) -> "RemoteRequestHandle":
        from ray.serve.exceptions import BackPressureError

        remote = to_wire(work, prefix_hashes(work.prompt_token_ids) if self._prefix_affinity else ())
        for attempt in range(ADMISSION_ATTEMPTS):
            stream = self._deployment.options(stream=True).generate.remote(remote)
            try:
                first = await stream.__anext__()
                break
            except BackPressureError:
                raise Overloaded(
                    "every engine replica's queue is full; retry later", retry_after=self._retry_after
                ) from None
            except Exception as exc:
                # the replica died before it answered (the router has not
                # heard yet): nothing ran, so another replica may take it
                log.warning("engine replica lost before admission", request_id=work.request_id,
                            attempt=attempt + 1, error=repr(exc))
        else:
            raise Unavailable("no engine replica is serving", retry_after=self._retry_after)
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Admitted), first
        return RemoteRequestHandle(work, first, stream, self._retry_after, self._loop)


class RemoteRequestHandle(IteratedHandle):
    """A request a replica admitted: an async iterator of `Delta`, like
    `RequestHandle`. Iteration raises the error the replica failed the
    request with, or `ReplicaLost` if the replica died."""

    def __init__(self, work: Work, admitted: Admitted, stream, retry_after: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = work.request_id
        self.work = work
        self.n = work.params.n
        self.max_tokens = admitted.max_tokens
        self.usage = Usage(prompt_tokens=len(work.prompt_token_ids))
        #: the replica serving this request (the `x-lockgate-replica` header)
        self.replica = admitted.replica
        self.finished = False
        self._stream = stream
        self._retry_after = retry_after
        self._loop = loop
        self._ready: collections.deque[Delta] = collections.deque()

    async def __anext__(self) -> Delta:
        while not self._ready:
            if self.finished:
                raise StopAsyncIteration
            message = await self._next_message()
            if isinstance(message, Finished):
                message.complete(self.usage)
                self.finished = True
                raise StopAsyncIteration
            if isinstance(message, Failed):
                self.finished = True
                raise message.error
            self._ready.extend(message)
        delta = self._ready.popleft()
        self.usage.completion_tokens += len(delta.token_ids)
        return delta

    async def _next_message(self):
        try:
            return await self._stream.__anext__()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # StopAsyncIteration included: it ended without Finished
            self.finished = True
            log.warning("engine replica lost mid-request", request_id=self.request_id,
                        replica=self.replica, error=repr(exc))
            raise ReplicaLost(
                f"the engine replica serving this request ({self.replica}) stopped; retry the request",
                retry_after=self._retry_after,
            ) from None

    def abort(self) -> None:
        """Cancel the request at its replica (which frees its KV pages)."""
        self.stop_reading()
        if not self.finished:
            self.finished = True
            # the pipeline aborts from its worker thread when a later prompt fails
            self._loop.call_soon_threadsafe(self._stream.cancel)
