"""Handing the engine thread's results to the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockgate.engine.handle import RequestHandle

Events = list[tuple["RequestHandle", Any]]


class Outbox:
    """Results of engine steps on their way to the handles, on the event loop.

    Steps whose results the loop has not taken yet share its one scheduled
    hand-over: a loop that falls behind takes several steps at once, with
    one wake-up instead of one per step (each wake-up is a write to the
    loop's self-pipe and a turn of the GIL).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: Events = []
        self._lock = threading.Lock()
        self._scheduled = False

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver on `loop` from now on; what a closed loop never took is nobody's."""
        self._loop = loop
        with self._lock:
            self._events = []
            self._scheduled = False

    def deliver(self, events: Events) -> None:
        """Hand a step's results (handle, delta / END / exception) over."""
        if not events or self._loop is None:
            return
        with self._lock:
            self._events.extend(events)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._events.clear()
                self._scheduled = False

    def _hand_over(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            self._scheduled = False
        for handle, item in events:
            handle.put(item)
