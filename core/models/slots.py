"""A configured model's place in a server's fleet (`fleet.ModelFleet`):
what it is to load (`ModelPlan`), its state and load (`ModelSlot`,
`Loaded`), and a request's hold on it (`Lease`)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockgate.memory import trim_allocator
from lockgate.models.loading import Model

if TYPE_CHECKING:
    from lockgate.models.fleet import ModelFleet

UNLOADED, LOADING, READY, DRAINING = "unloaded", "loading", "ready", "draining"


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """A model the server is configured to serve: its name, what to load
    (`settings`, whose `model` is the file and `served_model_name` the
    name), and how long it stays."""

    name: str
    #: the settings it loads with (`lockgate.settings.Settings`); None for a
    #: model handed to the server loaded (`ModelFleet.of_loaded`), which
    #: cannot be loaded again
    settings: Any
    aliases: tuple[str, ...] = ()
    #: seconds idle before it unloads; None: it stays
    idle_ttl: float | None = None
    #: loaded at start-up and never unloaded but on request
    pinned: bool = False
    #: the file or directory, where known before loading (`/api/tags`)
    path: Path | None = None


@dataclasses.dataclass
class Loaded:
    """One load of a model: what requests lease."""

    model: Model
    #: requests holding it now
    leases: int = 0
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    #: the `keep_alive` the last request that gave one asked for (seconds)
    keep_alive: float | None = None
    #: when it unloads if still idle (monotonic); None: never by time
    expires: float | None = None

    def stop(self, close: bool) -> None:
        """Stop the model's engine (what still runs fails with 503), and
        close the model."""
        engine = self.model.engine
        engine.shutdown(0.0)
        if close:
            self.model.close()
        if hasattr(engine, "on_exit"):
            engine.on_exit = None  # the fleet's callback: a cycle through the model


def reclaim_memory() -> None:
    """What this process held of an unloaded model (its tokenizer, its
    grammar engine's vocabulary: tens of MiB for a 150k-token vocabulary)
    goes back to the system, not to the allocator's free lists."""
    gc.collect()
    trim_allocator()


class ModelSlot:
    """A configured model's place in the fleet."""

    def __init__(self, plan: ModelPlan) -> None:
        self.plan = plan
        #: when the server took it on (`/v1/models`' `created`)
        self.created = int(time.time())
        self.state = UNLOADED
        self.loaded: Loaded | None = None
        self.loading: asyncio.Task | None = None
        #: a load under way that has its room (counted against the limits)
        self.has_room = False
        #: why a load under way waits for room, while it does
        self.waiting_for_room: str | None = None
        #: bytes the model's executor holds ({"weights", "kv_cache"}), from its
        #: reservation; kept after an unload (what the next load will take)
        self.memory: dict[str, int] | None = None
        #: why the last load failed, until one succeeds
        self.error: str | None = None
        self.loads = 0

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def memory_bytes(self) -> int:
        return sum((self.memory or {}).values())

    @property
    def holds_memory(self) -> bool:
        """Counted against the limits: loaded, draining, or a load that has its room."""
        return self.state in (READY, DRAINING) or (self.state == LOADING and self.has_room)

    def describe(self) -> dict[str, Any]:
        """The slot for `/v1/models` and `/health`: state, memory, leases."""
        out: dict[str, Any] = {"state": self.state, "pinned": self.plan.pinned, "loads": self.loads}
        if self.memory is not None:
            out["memory"] = dict(self.memory)
        if self.loaded is not None:
            out["requests"] = self.loaded.leases
            if self.loaded.expires is not None:
                out["expires_in"] = max(0.0, round(self.loaded.expires - time.monotonic(), 1))
        if self.error is not None:
            out["error"] = self.error
        return out


class Lease:
    """A request's hold on a loaded model: it stays loaded until `release`.
    `keep_alive` (seconds; 0 unload when idle; negative: never by time),
    set before the release, replaces the plan's TTL from then on."""

    def __init__(self, fleet: "ModelFleet", slot: ModelSlot, loaded: Loaded) -> None:
        self._fleet = fleet
        self.slot = slot
        self.loaded = loaded
        self.model = loaded.model
        self.keep_alive: float | None = None
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._fleet._release(self)
