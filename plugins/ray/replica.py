"""An engine replica: one model, executor and engine in a Ray Serve replica
process, serving `RemoteWork` from the front as a stream of wire messages.

Its engine is the same `Engine` a single-process server runs; the replica
only translates. Admission errors travel back as `Failed` before
`Admitted`, so the front raises them before its response starts; a client
that goes away cancels the stream, which aborts the engine request and
frees its KV pages here.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import structlog

from lockgate.engine import Delta
from lockgate.engine.handle import RecordingObserver
from lockgate.errors import InternalError, LockgateError
from lockgate.plugins.ray.board import POST_EVERY
from lockgate.engine.wire import Admitted, Failed, Finished, RemoteWork, from_wire

log = structlog.get_logger("lockgate.ray")


class EngineReplica:
    """The body of the Ray Serve deployment (see `deployment.engine_deployment`)."""

    async def __init__(self, settings, board_name: str | None, namespace: str | None) -> None:
        import ray
        from ray import serve

        from lockgate.logging import configure_logging
        from lockgate.models import load_model_from_settings
        from lockgate.plugin_api.manager import get_plugin_manager

        configure_logging(settings.log_format, settings.log_level)
        self.replica = serve.get_replica_context().replica_id.unique_id
        structlog.contextvars.bind_contextvars(replica=self.replica)
        loop = asyncio.get_running_loop()
        # compiling or loading the model takes seconds: off the replica's loop
        self.model = await loop.run_in_executor(None, load_model_from_settings, get_plugin_manager(), settings)
        self.engine = self.model.engine
        self.recorder = RecordingObserver()
        self.engine.observer = self.recorder
        self.engine.start(loop)
        #: requests this replica admitted since it started (its share, in /health)
        self.admitted = 0
        self._board = None if board_name is None else ray.get_actor(board_name, namespace=namespace)
        self._poster = loop.create_task(self._post_forever())
        log.info("replica serving", model=self.model.name, pid=os.getpid())

    def describe(self) -> dict[str, Any]:
        """What the front needs of the engine to answer for it."""
        return {"context_length": self.engine.context_length, "max_n": self.engine.max_n,
                "vocab_size": self.model.vocab_size}

    async def generate(self, remote: RemoteWork):
        """The wire messages of one request (see `lockgate.engine.wire`).

        Deltas go out in lists: whatever the engine delivered while the last
        message was on its way goes in the next, so a busy replica sends
        fewer, larger messages (each costs the same few hundred µs in Ray)."""
        try:
            work = from_wire(remote, self.model.grammar_from_source)
            handle = self.engine.add(work)
        except LockgateError as exc:
            yield Failed(exc)
            return
        self.admitted += 1
        yield Admitted(self.replica, handle.max_tokens)
        ready: list[Delta] = []
        ended: list[BaseException | None] = []
        arrived = asyncio.Event()

        def deliver(item: Delta | BaseException | None) -> None:
            if isinstance(item, Delta):
                ready.append(item)
            else:
                ended.append(item)
            arrived.set()

        handle.subscribe(deliver)
        try:
            while True:
                await arrived.wait()
                arrived.clear()
                if ready:
                    batch = ready[:]
                    ready.clear()
                    yield batch
                if ended:
                    break
            outcome = ended[0]
            if outcome is None:
                yield Finished.of(handle.usage)
            elif isinstance(outcome, LockgateError):
                yield Failed(outcome)
            else:
                log.error("request failed in the replica", request_id=work.request_id, error=repr(outcome))
                yield Failed(InternalError("the engine failed"))
        finally:
            # the stream was cancelled (client gone) or closed early
            if not handle.finished:
                handle.abort()

    def check_health(self) -> None:
        """Ray Serve's health check: an engine that declared itself unhealthy
        gets its replica restarted."""
        if not self.engine.healthy:
            raise RuntimeError(f"engine unhealthy: {self.engine.unhealthy_reason}")

    def figures(self) -> dict[str, Any]:
        stats = self.engine.stats().as_dict()
        return {**stats, "requests_admitted": self.admitted, "healthy": self.engine.healthy,
                "pid": os.getpid(), "at": time.time()}

    async def _post_forever(self) -> None:
        while self._board is not None:
            try:
                self._board.post.remote(self.replica, self.figures(), self.recorder.take())
            except Exception:  # the board is gone: the front is shutting down
                log.warning("cannot post to the replica board", exc_info=True)
            await asyncio.sleep(POST_EVERY)

    def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(0.0)
