"""The models a server answers for and their lifecycle: `ModelFleet`.

Each configured model (`ModelPlan`) has a slot whose state is one of
unloaded -> loading -> ready -> draining -> unloaded. A request names a
model and holds a `Lease` on it for as long as it runs:

* a request for a model that is not ready starts its load, or joins the
  one under way (single flight: twenty first requests start one load), and
  waits up to `load_wait` seconds; past that it gets a 503 with
  `Retry-After`, before any byte of its answer;
* a load first makes room: the least recently used idle model (no lease,
  not pinned) is unloaded while the count (`max_models`) would be
  exceeded, and again, once the executor says what it is about to
  allocate (`ExecutorOptions.reserve`: weights and KV cache, in bytes),
  while the memory budget would be; a model larger than the whole budget
  fails to load with that said;
* a ready model unloads when idle past its TTL (the plan's, or the
  `keep_alive` of the last request that named it: 0 unloads it as soon as
  it is idle, a negative value never), when room is needed, when asked
  (`unload`), or when its engine dies (a child process that crashed); an
  unload drains: no new leases, the running requests get the server's
  shutdown grace, then the engine stops and the model closes.

The fleet runs on the event loop; loads and unloads run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from lockgate.errors import InvalidRequestError, ModelLoadError, ModelNotFound, Unavailable
from lockgate.models.loading import Model
from lockgate.models.slots import (
    DRAINING, LOADING, READY, UNLOADED, Lease, Loaded, ModelPlan, ModelSlot, reclaim_memory,
)

log = structlog.get_logger("lockgate.models")

#: `load(plan, progress, reserve)` -> Model, run in a worker thread
Loader = Callable[["ModelPlan", Callable[[str], None], Callable[[dict[str, int]], None] | None], Model]

_MIB = 1 << 20


class ModelFleet:
    """Every configured model's slot, and their loads and unloads."""

    def __init__(
        self,
        plans: list[ModelPlan],
        load: Loader,
        *,
        max_models: int | None = None,
        memory_budget: int | None = None,
        load_wait: float = 300.0,
        drain_grace: float = 30.0,
        retry_after: int = 1,
        on_ready: Callable[[Model], None] = lambda model: None,
        on_unloaded: Callable[[Model], None] = lambda model: None,
    ) -> None:
        if max_models is not None and max_models < 1:
            raise ValueError(f"max_models must be at least 1, got {max_models}")
        self._slots: dict[str, ModelSlot] = {}
        for plan in plans:
            if plan.name in self._slots:
                raise ValueError(f"two models are named {plan.name!r}")
            self._slots[plan.name] = ModelSlot(plan)
        # names first: an alias never hides another model's name
        self._by_name = dict(self._slots)
        for slot in self._slots.values():
            for alias in slot.plan.aliases:
                self._by_name.setdefault(alias, slot)
        pinned = sum(plan.pinned for plan in plans)
        if max_models is not None and pinned > max_models:
            raise ValueError(f"{pinned} models are pinned, more than the {max_models} that may be loaded")
        self._load = load
        self.max_models = max_models
        self.memory_budget = memory_budget
        self.load_wait = load_wait
        self.drain_grace = drain_grace
        self.retry_after = retry_after
        self._on_ready = on_ready
        self._on_unloaded = on_unloaded
        #: set, and replaced by a new one, whenever a slot changes (`_notify`)
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None
        self._closing = False

    @classmethod
    def of_loaded(cls, models: list[Model], **options: Any) -> "ModelFleet":
        """A fleet of models loaded already (tests, embedding): pinned and
        ready; their engines start with the fleet and stop with it, and
        whoever loaded them closes them."""
        fleet = cls([ModelPlan(m.name, None, aliases=m.aliases, pinned=True, path=m.path) for m in models],
                    _cannot_load, **options)
        for model in models:
            slot = fleet._slots[model.name]
            slot.loaded, slot.state, slot.loads = Loaded(model), READY, 1
            memory = model.engine.stats().memory
            slot.memory = dict(memory) if memory else None
        return fleet

    # ----------------------------------------------------------- lookups

    def __iter__(self) -> Iterator[ModelSlot]:
        return iter(self._slots.values())

    def slot(self, name: Any) -> ModelSlot:
        """The slot a request's `model` names; 400 when it is missing or not
        a string, 404 when no configured model has that name."""
        if name is None:
            raise InvalidRequestError("you must provide a model parameter", param="model")
        if not isinstance(name, str):
            raise InvalidRequestError("model must be a string", param="model")
        try:
            return self._by_name[name]
        except KeyError:
            raise ModelNotFound(
                f"The model '{name}' does not exist. Served models: " + ", ".join(self._slots), param="model"
            ) from None

    def ready_models(self) -> list[Model]:
        """The models loaded now."""
        return [slot.loaded.model for slot in self if slot.state == READY and slot.loaded is not None]

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Begin on the running loop: load the pinned models (a failure
        stops start-up) and watch the idle ones' TTLs."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._closing = False
        for slot in self:
            if slot.state == READY:  # handed over loaded
                self._serve(slot, slot.loaded.model)
        loads = [self._start_load(slot) for slot in self if slot.plan.pinned and slot.state == UNLOADED]
        for load in loads:
            failure = await load
            if failure is not None:
                raise ModelLoadError(failure)
        self._reaper = _detached(self._reap_forever())

    async def close(self) -> None:
        """Unload every model (what runs is failed with 503 at once: the
        server's own shutdown grace has passed)."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for slot in self:
            if slot.loading is not None:
                await asyncio.wait([slot.loading])
        while any(slot.state == DRAINING for slot in self):  # unloads under way end first
            await self._wait_changed(1.0)
        await asyncio.gather(*(self._unload(slot, "shutdown", grace=0.0) for slot in self if slot.state == READY))

    # ----------------------------------------------------------- requests

    async def acquire(self, name: Any) -> Lease:
        """A lease on the model `name` names, loading it first if need be.
        Raises `ModelNotFound` (404), `Unavailable` (503 with Retry-After)
        when it is not ready within `load_wait` seconds or its load failed."""
        slot = self.slot(name)
        deadline = time.monotonic() + self.load_wait
        while True:
            if self._closing:
                raise Unavailable("the server is shutting down", retry_after=self.retry_after)
            if slot.state == READY and slot.loaded is not None:
                slot.loaded.leases += 1
                slot.loaded.last_used = time.monotonic()
                slot.loaded.expires = None
                return Lease(self, slot, slot.loaded)
            if slot.state == UNLOADED:
                self._start_load(slot)
            left = deadline - time.monotonic()
            load = slot.loading
            if load is not None and left > 0:
                try:
                    async with asyncio.timeout(left):
                        failure = await asyncio.shield(load)
                except TimeoutError:
                    left = 0
                else:
                    if failure is not None:
                        raise Unavailable(f"the model {slot.name!r} could not be loaded: {failure}",
                                          retry_after=self.retry_after)
                    continue
            elif left > 0:  # draining: loaded again once it is out
                await self._wait_changed(left)
                continue
            raise Unavailable(slot.waiting_for_room or f"the model {slot.name!r} is {slot.state} and not ready "
                              "yet; retry shortly", retry_after=self.retry_after)

    def _release(self, lease: Lease) -> None:
        loaded = lease.loaded
        loaded.leases -= 1
        loaded.last_used = time.monotonic()
        if lease.keep_alive is not None:
            loaded.keep_alive = lease.keep_alive
        if loaded.leases == 0:
            loaded.expires = self._expiry(lease.slot, loaded)
        self._notify()

    @staticmethod
    def _expiry(slot: ModelSlot, loaded: Loaded) -> float | None:
        """When an idle model unloads: its last `keep_alive`, else its
        plan's TTL, after its last use; never when pinned."""
        keep = loaded.keep_alive if loaded.keep_alive is not None else slot.plan.idle_ttl
        if keep is None or keep < 0 or slot.plan.pinned:
            return None
        return loaded.last_used + keep

    async def load(self, name: Any) -> ModelSlot:
        """Load the model `name` names (and wait for it); its slot."""
        lease = await self.acquire(name)
        lease.release()
        return lease.slot

    async def unload(self, name: Any) -> ModelSlot:
        """Unload the model `name` names, letting its running requests
        finish (up to the drain grace); its slot."""
        slot = self.slot(name)
        if slot.plan.settings is None:
            raise InvalidRequestError(f"the model {slot.name!r} was handed to the server loaded and cannot be "
                                      "unloaded", param="model")
        if slot.loading is not None:
            await asyncio.wait([slot.loading])
        if slot.state == READY:
            await self._unload(slot, "requested", grace=self.drain_grace)
        while slot.state == DRAINING:
            await self._wait_changed(1.0)
        return slot

    # ----------------------------------------------------------- loading

    def _start_load(self, slot: ModelSlot) -> asyncio.Task:
        slot.state = LOADING
        slot.loading = _detached(self._load_slot(slot))
        self._notify()
        return slot.loading

    async def _load_slot(self, slot: ModelSlot) -> str | None:
        """Load `slot`'s model; None, or why it failed."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            await self._make_room(slot, 0)
            slot.has_room = True

            def reserve(memory: dict[str, int]) -> None:
                asyncio.run_coroutine_threadsafe(self._reserve(slot, memory), loop).result()

            def progress(message: str) -> None:
                log.info(message, model=slot.name)

            # told only where a budget applies (a plugin's loader may not take it)
            model = await loop.run_in_executor(None, self._load, slot.plan, progress,
                                               None if self.memory_budget is None else reserve)
        except Exception as exc:  # noqa: BLE001 - the slot says why; waiting requests get a 503
            slot.error = str(exc) or type(exc).__name__
            slot.state = UNLOADED
            log.error("model failed to load", model=slot.name, error=slot.error)
            return slot.error
        else:
            slot.loaded = Loaded(model)
            memory = model.engine.stats().memory
            slot.memory = dict(memory) if memory else slot.memory
            slot.error = None
            slot.loads += 1
            slot.state = READY
            self._serve(slot, model)
            # a model no request has used yet unloads by its TTL as well
            if slot.plan.idle_ttl is not None and not slot.plan.pinned:
                slot.loaded.expires = time.monotonic() + slot.plan.idle_ttl
            log.info("model ready", model=slot.name, seconds=round(time.monotonic() - started, 2),
                     memory_mib=round(slot.memory_bytes / _MIB, 1))
            return None
        finally:
            slot.loading = None
            slot.has_room = False
            slot.waiting_for_room = None
            self._notify()

    def _serve(self, slot: ModelSlot, model: Model) -> None:
        engine = model.engine
        if hasattr(engine, "on_exit"):  # an engine in a process of its own says when it dies
            engine.on_exit = lambda reason: _detached(self._lost(slot, model, reason))
        self._on_ready(model)
        engine.start(self._loop)

    async def _reserve(self, slot: ModelSlot, memory: dict[str, int]) -> None:
        """The executor of `slot`'s load is about to allocate `memory`: make
        room for it under the budget, or refuse."""
        need = sum(memory.values())
        if self.memory_budget is not None and need > self.memory_budget:
            raise ModelLoadError(
                f"it needs {need / _MIB:.1f} MiB (weights {memory.get('weights', 0) / _MIB:.1f}, "
                f"KV cache {memory.get('kv_cache', 0) / _MIB:.1f}), more than the whole memory budget "
                f"of {self.memory_budget / _MIB:.1f} MiB (--models-memory)"
            )
        await self._make_room(slot, need)
        slot.memory = dict(memory)

    async def _make_room(self, slot: ModelSlot, need: int) -> None:
        """Unload idle models, least recently used first, until `slot` fits
        under the count and, with `need` bytes, under the memory budget;
        waits for a model to go idle while none is, up to `load_wait`."""
        deadline = time.monotonic() + self.load_wait
        while True:
            others = [s for s in self if s is not slot and s.holds_memory]
            over = self._over(others, need)
            if over is None:
                return
            # what is unloading already makes room once it is out
            if self._over([s for s in others if s.state != DRAINING], need) is None:
                await self._wait_changed(1.0)
                continue
            victim = self._least_recently_used_idle(exclude=slot)
            if victim is not None:
                log.info("unloading to make room", model=victim.name, for_model=slot.name, reason=over)
                self._unload(victim, "room", grace=0.0)
                await self._wait_changed(1.0)
                continue
            busy = ", ".join(s.name for s in others)
            slot.waiting_for_room = f"no room to load {slot.name!r}: every loaded model ({busy}) is busy " \
                "or pinned; retry shortly"
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(slot.waiting_for_room, retry_after=self.retry_after)
            await self._wait_changed(left)
            slot.waiting_for_room = None

    def _over(self, others: list[ModelSlot], need: int) -> str | None:
        """Which limit one more model of `need` bytes beside `others` is
        over ("count" or "memory"), or None."""
        if self.max_models is not None and len(others) + 1 > self.max_models:
            return "count"
        if self.memory_budget is not None and sum(s.memory_bytes for s in others) + need > self.memory_budget:
            return "memory"
        return None

    def _least_recently_used_idle(self, exclude: ModelSlot) -> ModelSlot | None:
        idle = [s for s in self if s is not exclude and s.state == READY and not s.plan.pinned
                and s.loaded is not None and s.loaded.leases == 0]
        return min(idle, key=lambda s: s.loaded.last_used, default=None)

    # ----------------------------------------------------------- unloading

    def _unload(self, slot: ModelSlot, reason: str, *, grace: float) -> asyncio.Future:
        """Begin unloading a ready `slot`: it drains from now on (no new
        leases; its requests get `grace` seconds), and a task of its own
        (never cut short by whoever began it) stops and closes the model.
        What to await for the unload's end (done at once where the slot was
        not ready)."""
        if slot.state != READY or slot.loaded is None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        slot.state = DRAINING
        self._notify()
        return _detached(self._drain_and_stop(slot, slot.loaded, reason, grace))

    async def _drain_and_stop(self, slot: ModelSlot, loaded: Loaded, reason: str, grace: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + grace
        while loaded.leases > 0 and time.monotonic() < deadline:
            await self._wait_changed(deadline - time.monotonic())
        log.info("unloading model", model=slot.name, reason=reason, running=loaded.leases)
        # a model handed over loaded is closed by whoever loaded it
        await loop.run_in_executor(None, loaded.stop, slot.plan.settings is not None)
        slot.loaded = None
        slot.state = UNLOADED
        self._on_unloaded(loaded.model)
        self._notify()
        loaded = None  # the last reference here: what the model held goes with the reclaim
        await loop.run_in_executor(None, reclaim_memory)

    async def _lost(self, slot: ModelSlot, model: Model, reason: str) -> None:
        """`model`'s engine died under it: the slot unloads, and the next
        request for it loads it again."""
        if slot.loaded is None or slot.loaded.model is not model:
            return
        slot.error = f"its engine stopped: {reason}"
        await self._unload(slot, "lost", grace=0.0)

    async def _reap_forever(self) -> None:
        """Unload idle models whose TTL passed."""
        while True:
            now = time.monotonic()
            for slot in self:
                loaded = slot.loaded
                if slot.state == READY and loaded is not None and loaded.leases == 0 \
                        and loaded.expires is not None and loaded.expires <= now:
                    self._unload(slot, "idle", grace=0.0)
            await self._wait_changed(self._next_expiry() - time.monotonic())

    def _next_expiry(self) -> float:
        times = [s.loaded.expires for s in self if s.state == READY and s.loaded is not None
                 and s.loaded.leases == 0 and s.loaded.expires is not None]
        return min(times, default=time.monotonic() + 60.0)

    # ----------------------------------------------------------- waiting

    def _notify(self) -> None:
        """Wake whatever waits for a change (`_wait_changed`)."""
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def _wait_changed(self, timeout: float) -> bool:
        """Wait for the next change, up to `timeout` seconds; False when
        none came. Called with no await since the state it saw was read,
        so no change between the two is missed."""
        if timeout <= 0:
            return False
        try:
            # `asyncio.timeout`, not `wait_for`: 3.11's `wait_for` can miss a
            # cancellation that comes as the event is set, and hang its task
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return True


def _detached(coroutine) -> asyncio.Task:
    """A task of the fleet's own, outside the context of the request that
    set it off (a load serves every request that waits for it: its log
    lines carry no one request's id)."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())


def _cannot_load(plan: ModelPlan, progress, reserve) -> Model:
    raise ModelLoadError(f"the model {plan.name!r} was handed to the server loaded and cannot be loaded again")
