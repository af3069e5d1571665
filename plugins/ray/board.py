"""The replicas' notice board: each replica posts its engine's figures and
metric events here twice a second; the front reads them for `/health` and
`/metrics`. A replica that stops posting (its process died) drops off."""

from __future__ import annotations

import time
from typing import Any

#: seconds without a post after which a replica counts as gone
STALE_AFTER = 3.0
#: seconds between a replica's posts
POST_EVERY = 0.5


class ReplicaBoard:
    """A Ray actor (created by the front, one per served model)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}
        self._events: list[tuple[str, dict[str, Any]]] = []

    def post(self, replica: str, figures: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> None:
        self._posts[replica] = (time.monotonic(), figures)
        self._events.extend(events)

    def read(self) -> tuple[dict[str, dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """The figures of every replica that posted lately, and the events
        posted since the last read (each event is read once)."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._posts.items() if now - at > STALE_AFTER]:
            del self._posts[replica]
        events, self._events = self._events, []
        return {replica: figures for replica, (_, figures) in self._posts.items()}, events
