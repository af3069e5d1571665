"""The child process's side: load one model and serve the front's
`RemoteWork` with the same `Engine` a single-process server runs.

What crosses the pipe, each way a list of messages per send (one event
loop turn's worth):

* front -> child: `("reserved",)` or `("refused", error)` while loading;
  then `("add", key, RemoteWork)`, `("abort", key)`, `("stop", grace)`;
* child -> front: `("progress", text)`, `("reserve", {"weights": bytes,
  "kv_cache": bytes})`, then `("ready", description)` or `("failed",
  error)`; then per request `("admitted", key, Admitted)` or `("failed",
  key, Failed)`, `("delta", key, Delta)`..., `("finished", key, Finished)`
  or `("failed", key, Failed)`; and every `POST_EVERY` seconds
  `("figures", stats, events)`.

The child ends when told to stop or when the front goes away (the pipe
reads EOF), so a front that dies leaves no model process behind. It runs in
a session of its own and ignores SIGINT and SIGTERM: a service manager
that signals every process of the server stops the front, which stops its
models after their requests' grace.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import structlog

from lockgate.engine import Delta
from lockgate.engine.handle import RecordingObserver
from lockgate.engine.wire import Admitted, Failed, Finished, RemoteWork, from_wire
from lockgate.errors import InternalError, LockgateError, ModelLoadError

log = structlog.get_logger("lockgate.process")

#: seconds between the child's posts of its figures
POST_EVERY = 0.5


def run_child(conn) -> None:
    """The child process's body: read the front's `sys.path`, settings and
    plugin recipe, load the model the settings name with the plugins the
    recipe builds, then serve until stopped."""
    from lockgate.logging import configure_logging
    from lockgate.models import load_model_from_settings

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path, settings, recipe = conn.recv()
    # the front's modules (a plugin that is not installed, a test's helpers) import here too
    sys.path[:] = path
    configure_logging(settings.log_format, settings.log_level)
    structlog.contextvars.bind_contextvars(model=settings.served_model_name or settings.model_source, pid=os.getpid())
    try:
        pm = recipe.build()
        pm.hook.lockgate_serving_process()
        model = load_model_from_settings(pm, settings, progress=lambda text: conn.send([("progress", text)]),
                                         reserve=lambda memory: _reserve(conn, memory))
    except BaseException as exc:  # noqa: BLE001 - told to the front, which raises it
        conn.send([("failed", _load_error(exc))])
        conn.close()
        return
    try:
        asyncio.run(ChildServer(conn, model).serve())
    finally:
        model.close()
        conn.close()


def _reserve(conn, memory: dict[str, int]) -> None:
    conn.send([("reserve", memory)])
    [reply] = conn.recv()
    if reply[0] != "reserved":
        raise reply[1]


def _load_error(exc: BaseException) -> BaseException:
    """`exc` as the front raises it: a `ModelLoadError` keeps its words; an
    error the front could not unpickle, or would not know, is told by type
    and message."""
    if isinstance(exc, (ModelLoadError, LockgateError)):
        return exc
    return ModelLoadError(f"{type(exc).__name__}: {exc}")


class ChildServer:
    """The child's event loop side: admits the front's work into the engine
    and sends back what each request produces."""

    def __init__(self, conn, model) -> None:
        self.conn = conn
        self.model = model
        self.engine = model.engine
        self.recorder = RecordingObserver()
        self.engine.observer = self.recorder
        self.handles: dict[int, Any] = {}
        #: keys aborted before their admission ended
        self.aborted: set[int] = set()
        self._outbox: list[tuple] = []
        self._send_lock = threading.Lock()
        self._stop: asyncio.Future | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self.engine.start(loop)
        self._send(("ready", self.describe()))
        reader = threading.Thread(target=self._read, args=(loop,), name="lockgate-child-reader", daemon=True)
        reader.start()
        poster = loop.create_task(self._post_forever())
        log.info("model process serving", model=self.model.name)
        grace = await self._stop
        poster.cancel()
        # what is still running gets `grace` seconds, then a 503
        await loop.run_in_executor(None, self.engine.shutdown, grace)
        await asyncio.sleep(0)  # the engine's last deliveries
        self._flush()

    def describe(self) -> dict[str, Any]:
        """What the front needs of the engine to answer for it."""
        return {"context_length": self.engine.context_length, "max_n": self.engine.max_n,
                "pid": os.getpid(), "figures": self.figures()}

    def figures(self) -> dict[str, Any]:
        return {**self.engine.stats().as_dict(), "healthy": self.engine.healthy,
                "unhealthy_reason": self.engine.unhealthy_reason, "pid": os.getpid()}

    # ----------------------------------------------------------- the pipe

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                messages = self.conn.recv()
            except (EOFError, OSError):
                # the front is gone: nobody reads what this process makes
                loop.call_soon_threadsafe(self._stopping, 0.0)
                return
            loop.call_soon_threadsafe(self._dispatch, messages)

    def _dispatch(self, messages: list[tuple]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "add":
                asyncio.ensure_future(self._admit(message[1], message[2]))
            elif kind == "abort":
                handle = self.handles.get(message[1])
                if handle is None:
                    self.aborted.add(message[1])
                else:
                    handle.abort()
            elif kind == "stop":
                self._stopping(message[1])

    def _stopping(self, grace: float) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(grace)

    def _send(self, message: tuple) -> None:
        """Queue `message`; what one loop turn queues goes in one send."""
        self._outbox.append(message)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if not self._outbox:
            return
        messages, self._outbox = self._outbox, []
        with self._send_lock:
            try:
                self.conn.send(messages)
            except (OSError, ValueError):  # the front is gone
                self._stopping(0.0)

    # ----------------------------------------------------------- requests

    async def _admit(self, key: int, remote: RemoteWork) -> None:
        loop = asyncio.get_running_loop()
        try:
            # a grammar is rebuilt here (milliseconds to seconds): off the loop
            handle = await loop.run_in_executor(None, self._add, remote)
        except LockgateError as exc:
            self._send(("failed", key, Failed(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the front answers it as a 500
            log.error("admission failed in the model process", error=repr(exc), exc_info=True)
            self._send(("failed", key, Failed(InternalError("the engine failed"))))
            return
        if key in self.aborted:
            self.aborted.discard(key)
            handle.abort()
            self._send(("failed", key, Failed(InternalError("aborted"))))
            return
        self.handles[key] = handle
        self._send(("admitted", key, Admitted(None, handle.max_tokens)))

        def deliver(item: Delta | BaseException | None) -> None:
            if isinstance(item, Delta):
                self._send(("delta", key, item))
                return
            self.handles.pop(key, None)
            if item is None:
                self._send(("finished", key, Finished.of(handle.usage)))
            elif isinstance(item, LockgateError):
                self._send(("failed", key, Failed(item)))
            else:
                log.error("request failed in the model process", request_id=handle.request_id, error=repr(item))
                self._send(("failed", key, Failed(InternalError("the engine failed"))))

        handle.subscribe(deliver)

    def _add(self, remote: RemoteWork):
        return self.engine.add(from_wire(remote, self.model.grammar_from_source))

    async def _post_forever(self) -> None:
        while True:
            self._send(("figures", self.figures(), self.recorder.take()))
            await asyncio.sleep(POST_EVERY)


if __name__ == "__main__":
    # `python -m lockgate.plugins.process.child FD`: FD is this end of the front's socket pair
    run_child(Connection(int(sys.argv[1])))
