"""The front's side of a model in a child process: `ChildEngine`, an
`EngineClient` whose requests run in the child (`child.run_child`).

`add` runs in the pipeline's worker thread, like `Engine.add`, and returns
once the child admitted the work or refused it, so a refusal is raised
before the response starts. What the child sends is read by one thread and
handed to the event loop, where each request's deltas reach an ordinary
`RequestHandle`. When the child dies, every request it held fails with a
503 (`ModelProcessLost`), the engine reports itself unhealthy, and
`on_exit` tells whoever holds the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import structlog

from lockgate.engine import EngineObserver, EngineStats, Work
from lockgate.engine.handle import END, RecordingObserver, RequestHandle
from lockgate.engine.wire import ADMISSION_TIMEOUT, to_wire
from lockgate.errors import ModelLoadError, Unavailable

log = structlog.get_logger("lockgate.process")

#: seconds `close` waits for the child to end before it is killed
EXIT_TIMEOUT = 10.0


class ModelProcessLost(Unavailable):
    """The process running a request's model stopped (503)."""

    code = "model_process_lost"


class ChildEngine:
    """A model's engine in a child process, seen from the front."""

    def __init__(self, name: str, process, conn, description: dict[str, Any], *, retry_after: int) -> None:
        self.name = name
        self.context_length: int = description["context_length"]
        self.max_n: int = description["max_n"]
        self.pid: int = description["pid"]
        self.observer = EngineObserver()
        self.unhealthy_reason: str | None = None
        #: called on the event loop, once, when the child ends without being asked to
        self.on_exit: Callable[[str], None] | None = None
        self._process = process
        self._conn = conn
        self._figures: dict[str, Any] = description["figures"]
        self._retry_after = retry_after
        self._keys = itertools.count()
        self._send_lock = threading.Lock()
        #: admissions waiting for the child's answer: key -> (work, future)
        self._pending: dict[int, tuple[Work, concurrent.futures.Future]] = {}
        #: admitted requests by key (touched on the event loop only)
        self._handles: dict[int, ChildRequestHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._lost: str | None = None

    @classmethod
    def launch(cls, name: str, settings, recipe, *, progress: Callable[[str], None] | None = None,
              reserve: Callable[[dict[str, int]], None] | None = None) -> "ChildEngine":
        """Start a child that loads the model `settings` name with the
        plugins `recipe` builds; return once it serves. `reserve(memory)`
        answers the child's reservation (raising refuses it). Raises
        `ModelLoadError` when the child fails to load or dies loading."""
        # A new interpreter running `child`, not multiprocessing's spawn,
        # which would import the front's main module again (a script
        # without a `__main__` guard would run twice).
        ours, theirs = socket.socketpair()
        with theirs:
            # a session of its own: a terminal's Ctrl-C stops the front, which
            # stops its models in order, rather than every process at once
            process = subprocess.Popen([sys.executable, "-m", "lockgate.plugins.process.child", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], start_new_session=True)
        conn = Connection(ours.detach())
        started = time.monotonic()
        try:
            conn.send((list(sys.path), settings, recipe))
            while True:
                try:
                    messages = conn.recv()
                except (EOFError, OSError):
                    process.wait(EXIT_TIMEOUT)
                    raise ModelLoadError(
                        f"the process loading {name!r} ended (exit code {process.returncode}) before it served"
                    ) from None
                for message in messages:
                    kind = message[0]
                    if kind == "progress" and progress is not None:
                        progress(message[1])
                    elif kind == "reserve":
                        cls._answer_reservation(conn, reserve, message[1])
                    elif kind == "failed":
                        raise message[1]
                    elif kind == "ready":
                        log.info("model process loaded", model=name, pid=message[1]["pid"],
                                 seconds=round(time.monotonic() - started, 2))
                        return cls(name, process, conn, message[1],
                                   retry_after=settings.engine_options().retry_after)
        except BaseException:
            _end(process, conn, 0.0)
            raise

    @staticmethod
    def _answer_reservation(conn, reserve, memory: dict[str, int]) -> None:
        if reserve is None:
            conn.send([("reserved",)])
            return
        try:
            reserve(memory)
        except Exception as exc:  # noqa: BLE001 - the child raises it, and the load fails with it
            conn.send([("refused", exc)])
        else:
            conn.send([("reserved",)])

    # ----------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin reading what the child sends; deltas are delivered on `loop`."""
        if self._reader is None:
            self._loop = loop
            self._reader = threading.Thread(target=self._read, name=f"lockgate-{self.name}-reader", daemon=True)
            self._reader.start()

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting; the child gives what runs `grace_seconds`, then
        fails the rest with 503, and ends."""
        if not self._stopping:
            self._stopping = True
            self._send([("stop", grace_seconds)])

    def close(self) -> None:
        """End the child (killed if it does not end by itself), which gives
        its memory back."""
        self.shutdown(0.0)
        _wait(self._process, EXIT_TIMEOUT)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(EXIT_TIMEOUT)
        _end(self._process, self._conn, 0.0)

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None and not self._stopping and self._lost is None \
            and bool(self._figures.get("healthy", True))

    def stats(self) -> EngineStats:
        """The child's last posted figures (its pid, health and memory among them)."""
        return EngineStats.from_dict(self._figures)

    # ----------------------------------------------------------- admission

    def add(self, work: Work) -> "ChildRequestHandle":
        """Send `work` to the child; return once it is admitted. Raises what
        the child's engine raised, or `Unavailable` when the child is gone
        or does not answer."""
        if self._lost is not None or self._stopping or self._loop is None:
            raise Unavailable(f"the model {self.name!r} is not serving: "
                              + (self._lost or "it is being unloaded"), retry_after=self._retry_after)
        key = next(self._keys)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[key] = (work, future)
        if self._lost is not None:  # lost meanwhile: `_ended` may have taken the pending before this one
            self._pending.pop(key, None)
            raise ModelProcessLost(f"the model {self.name!r} stopped serving: {self._lost}",
                                   retry_after=self._retry_after)
        self._send([("add", key, to_wire(work))])
        try:
            return future.result(ADMISSION_TIMEOUT)
        except concurrent.futures.TimeoutError:
            if self._pending.pop(key, None) is not None:
                self._send([("abort", key)])
            raise Unavailable(f"the model's process did not take the request within {ADMISSION_TIMEOUT:g} s",
                              retry_after=self._retry_after) from None

    def abort(self, handle: "ChildRequestHandle") -> None:
        """Cancel `handle`'s request in the child (which frees its KV pages);
        called from the event loop or the pipeline's thread."""
        self._send([("abort", handle.key)])

    def _send(self, messages: list[tuple]) -> None:
        with self._send_lock:
            try:
                self._conn.send(messages)
            except (OSError, ValueError):
                pass  # the child is gone: the reader fails what it held

    # ----------------------------------------------------------- what the child sends

    def _read(self) -> None:
        while True:
            try:
                messages = self._conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._deliver, messages)
        _wait(self._process, EXIT_TIMEOUT)
        if not self._stopping:
            reason = f"its process ended (exit code {self._process.returncode})"
            log.error("model process lost", model=self.name, pid=self.pid, exit_code=self._process.returncode)
        else:
            reason = "it was unloaded"
        try:
            self._loop.call_soon_threadsafe(self._ended, reason, not self._stopping)
        except RuntimeError:  # the event loop closed first (the server stopped)
            pass

    def _deliver(self, messages: list[tuple]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "figures":
                self._figures = message[1]
                RecordingObserver.replay(message[2], self.observer)
            elif kind == "admitted":
                pending = self._pending.pop(message[1], None)
                if pending is None:  # given up on: free it there
                    self._send([("abort", message[1])])
                    continue
                work, future = pending
                handle = ChildRequestHandle(self, work, message[2].max_tokens, message[1])
                self._handles[message[1]] = handle
                future.set_result(handle)
            elif kind == "failed":
                pending = self._pending.pop(message[1], None)
                if pending is not None:
                    pending[1].set_exception(message[2].error)
                else:
                    handle = self._handles.pop(message[1], None)
                    if handle is not None:
                        handle.put(message[2].error)
            elif kind == "delta":
                handle = self._handles.get(message[1])
                if handle is not None:
                    handle.put(message[2])
            elif kind == "finished":
                handle = self._handles.pop(message[1], None)
                if handle is not None:
                    message[2].complete(handle.usage)
                    handle.put(END)

    def _ended(self, reason: str, unexpected: bool) -> None:
        """The child is gone: fail what it held, once."""
        if self._lost is not None:
            return
        self._lost = reason
        error = ModelProcessLost(f"the model {self.name!r} stopped serving: {reason}; retry the request",
                                 retry_after=self._retry_after)
        # taken whole: the pipeline's threads may be adding (`add` checks `_lost` after)
        pending, self._pending = self._pending, {}
        for _, future in pending.values():
            if not future.done():
                future.set_exception(error)
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.put(error)
        if unexpected:
            self.unhealthy_reason = f"the model's process stopped: {reason}"
            if self.on_exit is not None:
                self.on_exit(reason)


class ChildRequestHandle(RequestHandle):
    """A request the child admitted: a `RequestHandle` fed from the pipe,
    known to the child by `key`."""

    def __init__(self, engine: ChildEngine, work: Work, max_tokens: int, key: int) -> None:
        super().__init__(engine, work, max_tokens)
        self.key = key


def _wait(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def _end(process: subprocess.Popen, conn, timeout: float) -> None:
    """Wait up to `timeout` seconds for `process` to end, then kill it."""
    _wait(process, timeout)
    if process.poll() is None:
        log.warning("model process did not end; killing it", pid=process.pid)
        process.kill()
        _wait(process, EXIT_TIMEOUT)
    conn.close()
