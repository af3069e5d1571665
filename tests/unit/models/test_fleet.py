"""The models' lifecycle (`ModelFleet`) on loaders that load nothing: single
flight, room by count and by memory, TTLs and `keep_alive`, drains, a dead
engine, a failed load. The real loaders (a child process per model) are
tests/e2e/test_model_fleet.py's."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from lockgate.engine import EngineStats
from lockgate.errors import InvalidRequestError, ModelLoadError, ModelNotFound, Unavailable
from lockgate.models.fleet import DRAINING, LOADING, READY, UNLOADED, ModelFleet, ModelPlan

MIB = 1 << 20


class StubEngine:
    """What the fleet touches of an engine."""

    def __init__(self, name: str, memory: dict[str, int] | None) -> None:
        self.name = name
        self.memory = memory
        self.started = self.stopped = False
        self.healthy = True
        self.unhealthy_reason = None
        self.on_exit = None

    def start(self, loop) -> None:
        self.started = True

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        self.stopped = True

    def stats(self) -> EngineStats:
        return EngineStats(memory=self.memory)


class StubModel:
    def __init__(self, name: str, memory: dict[str, int] | None) -> None:
        self.name = name
        self.aliases = ()
        self.path = Path(f"/models/{name}.gguf")
        self.context_length = 512
        self.engine = StubEngine(name, memory)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Loader:
    """Loads a `StubModel` in the fleet's worker thread: reserves its memory
    (`memory[name]` MiB of weights), optionally waits for `gate`, or fails."""

    def __init__(self, memory: dict[str, int] | None = None, fail: set[str] = frozenset()) -> None:
        self.memory = memory or {}
        self.fail = set(fail)
        self.loads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.models: dict[str, StubModel] = {}

    def __call__(self, plan: ModelPlan, progress, reserve) -> StubModel:
        self.loads.append(plan.name)
        self.gate.wait(10)
        if plan.name in self.fail:
            raise ModelLoadError(f"cannot read {plan.name}.gguf")
        memory = {"weights": self.memory.get(plan.name, 1) * MIB, "kv_cache": 0}
        if reserve is not None:
            reserve(memory)
        model = StubModel(plan.name, memory)
        self.models[plan.name] = model
        return model


def plans(*names: str, **options) -> list[ModelPlan]:
    return [ModelPlan(name, settings=object(), **options) for name in names]


async def fleet_of(names, loader, **options) -> ModelFleet:
    fleet = ModelFleet(plans(*names, **options.pop("plan", {})), loader, **options)
    await fleet.start()
    return fleet


async def use(fleet: ModelFleet, name: str, keep_alive: float | None = None):
    lease = await fleet.acquire(name)
    lease.keep_alive = keep_alive
    lease.release()
    return lease.model


def states(fleet: ModelFleet) -> dict[str, str]:
    return {slot.name: slot.state for slot in fleet}


async def eventually(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_twenty_first_requests_start_one_load():
    loader = Loader()
    loader.gate.clear()
    fleet = await fleet_of(["a"], loader)
    waiting = [asyncio.ensure_future(fleet.acquire("a")) for _ in range(20)]
    await asyncio.sleep(0.05)
    assert states(fleet) == {"a": LOADING}
    loader.gate.set()
    leases = await asyncio.gather(*waiting)
    assert loader.loads == ["a"]
    assert {id(lease.model) for lease in leases} == {id(loader.models["a"])}
    assert loader.models["a"].engine.started
    slot = fleet.slot("a")
    assert slot.loaded.leases == 20 and slot.loads == 1
    for lease in leases:
        lease.release()
    assert slot.loaded.leases == 0
    await fleet.close()
    assert loader.models["a"].closed


async def test_a_load_past_the_count_unloads_the_least_recently_used_idle_model():
    loader = Loader()
    fleet = await fleet_of(["a", "b", "c"], loader, max_models=2)
    await use(fleet, "a")
    await use(fleet, "b")
    await use(fleet, "a")  # b is now the least recently used
    await use(fleet, "c")
    assert states(fleet) == {"a": READY, "b": UNLOADED, "c": READY}
    assert loader.models["b"].closed and loader.models["b"].engine.stopped
    await use(fleet, "b")
    assert states(fleet) == {"a": UNLOADED, "b": READY, "c": READY}
    assert loader.loads == ["a", "b", "c", "b"]
    await fleet.close()


async def test_a_busy_model_is_not_unloaded_for_room_and_the_wait_ends_in_a_503():
    fleet = await fleet_of(["a", "b"], Loader(), max_models=1, load_wait=0.3, retry_after=7)
    held = await fleet.acquire("a")
    with pytest.raises(Unavailable) as refused:
        await fleet.acquire("b")
    assert refused.value.headers == {"Retry-After": "7"}
    assert "busy" in refused.value.message
    assert states(fleet)["a"] == READY
    # once a is idle, b's load makes room (however slow the machine)
    fleet.load_wait = 30
    held.release()
    await use(fleet, "b")
    assert states(fleet) == {"a": UNLOADED, "b": READY}
    await fleet.close()


async def test_a_request_waiting_for_room_gets_it_when_the_busy_model_goes_idle():
    fleet = await fleet_of(["a", "b"], Loader(), max_models=1, load_wait=5)
    held = await fleet.acquire("a")
    waiting = asyncio.ensure_future(fleet.acquire("b"))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    held.release()
    lease = await waiting
    assert lease.model.name == "b" and states(fleet)["a"] == UNLOADED
    lease.release()
    await fleet.close()


async def test_the_memory_budget_counts_what_the_executor_reserves():
    loader = Loader(memory={"a": 40, "b": 50, "c": 30})
    fleet = await fleet_of(["a", "b", "c"], loader, memory_budget=100 * MIB)
    await use(fleet, "a")
    await use(fleet, "b")
    assert states(fleet) == {"a": READY, "b": READY, "c": UNLOADED}
    await use(fleet, "c")  # 40 + 50 + 30 > 100: a, the least recently used, goes
    assert states(fleet) == {"a": UNLOADED, "b": READY, "c": READY}
    assert fleet.slot("c").memory == {"weights": 30 * MIB, "kv_cache": 0}
    await fleet.close()


async def test_a_model_larger_than_the_budget_does_not_load_and_says_why():
    loader = Loader(memory={"a": 10, "huge": 200})
    fleet = await fleet_of(["a", "huge"], loader, memory_budget=100 * MIB)
    await use(fleet, "a")
    with pytest.raises(Unavailable) as refused:
        await fleet.acquire("huge")
    assert "200.0 MiB" in refused.value.message and "100.0 MiB" in refused.value.message
    assert states(fleet) == {"a": READY, "huge": UNLOADED}  # nothing unloaded for a load that cannot fit
    await fleet.close()


async def test_an_idle_model_unloads_after_its_ttl_and_loads_again_when_asked():
    loader = Loader()
    fleet = await fleet_of(["a"], loader, plan={"idle_ttl": 0.2})
    await use(fleet, "a")
    first = loader.models["a"]
    await eventually(lambda: states(fleet)["a"] == UNLOADED)
    assert first.closed
    await use(fleet, "a")
    assert loader.loads == ["a", "a"]
    await fleet.close()


async def test_keep_alive_zero_unloads_when_idle_and_negative_keeps_it():
    fleet = await fleet_of(["a", "b"], Loader(), plan={"idle_ttl": 0.2})
    await use(fleet, "a", keep_alive=0)
    await eventually(lambda: states(fleet)["a"] == UNLOADED)
    await use(fleet, "b", keep_alive=-1)
    await asyncio.sleep(0.5)
    assert states(fleet)["b"] == READY
    await fleet.close()


async def test_a_lease_keeps_its_model_past_the_ttl():
    fleet = await fleet_of(["a"], Loader(), plan={"idle_ttl": 0.1})
    lease = await fleet.acquire("a")
    await asyncio.sleep(0.3)
    assert states(fleet)["a"] == READY
    lease.release()
    await eventually(lambda: states(fleet)["a"] == UNLOADED)
    await fleet.close()


def test_more_pinned_models_than_may_be_loaded_is_refused():
    with pytest.raises(ValueError, match="pinned"):
        ModelFleet(plans("a", "b", pinned=True), Loader(), max_models=1)


async def test_a_pinned_model_stays_and_the_others_take_turns():
    loader = Loader()
    fleet = ModelFleet([ModelPlan("a", object(), pinned=True), *plans("b", "c")], loader, max_models=2)
    await fleet.start()
    assert loader.loads == ["a"] and states(fleet)["a"] == READY
    await use(fleet, "b")
    await use(fleet, "c")
    assert states(fleet) == {"a": READY, "b": UNLOADED, "c": READY}
    await fleet.close()


async def test_an_unload_drains_running_requests_first():
    loader = Loader()
    fleet = await fleet_of(["a"], loader, drain_grace=5)
    lease = await fleet.acquire("a")
    first = loader.models["a"]
    unloading = asyncio.ensure_future(fleet.unload("a"))
    await asyncio.sleep(0.1)
    assert states(fleet)["a"] == DRAINING and not first.engine.stopped
    # a request during the drain waits for the unload, then loads it again
    next_request = asyncio.ensure_future(fleet.acquire("a"))
    lease.release()
    await unloading
    assert first.closed
    again = await next_request
    assert loader.loads == ["a", "a"]
    again.release()
    await fleet.close()


async def test_a_dead_engine_unloads_its_model_and_the_next_request_loads_it_again():
    loader = Loader()
    fleet = await fleet_of(["a"], loader)
    await use(fleet, "a")
    first = loader.models["a"]
    first.engine.on_exit("its process ended (exit code -9)")
    await eventually(lambda: states(fleet)["a"] == UNLOADED)
    assert first.closed and "exit code -9" in fleet.slot("a").describe()["error"]
    await use(fleet, "a")
    assert loader.loads == ["a", "a"] and "error" not in fleet.slot("a").describe()
    await fleet.close()


async def test_a_failed_load_is_a_503_with_the_reason_and_is_tried_again():
    loader = Loader(fail={"a"})
    fleet = await fleet_of(["a"], loader)
    with pytest.raises(Unavailable) as refused:
        await fleet.acquire("a")
    assert "cannot read a.gguf" in refused.value.message
    assert states(fleet)["a"] == UNLOADED
    loader.fail.clear()
    await use(fleet, "a")
    assert loader.loads == ["a", "a"]
    await fleet.close()


async def test_names_and_aliases():
    fleet = ModelFleet([ModelPlan("a", object(), aliases=("b", "alpha")), ModelPlan("b", object())], Loader())
    assert fleet.slot("alpha").name == "a"
    assert fleet.slot("b").name == "b"  # a name is never hidden by another model's alias
    with pytest.raises(ModelNotFound, match="Served models: a, b"):
        fleet.slot("c")
    with pytest.raises(InvalidRequestError, match="must provide a model"):
        fleet.slot(None)
    with pytest.raises(InvalidRequestError, match="must be a string"):
        fleet.slot(3)


async def test_a_model_handed_over_loaded_serves_and_cannot_be_unloaded():
    model = StubModel("given", None)
    fleet = ModelFleet.of_loaded([model])
    await fleet.start()
    assert model.engine.started
    assert (await use(fleet, "given")) is model
    with pytest.raises(InvalidRequestError, match="cannot be unloaded"):
        await fleet.unload("given")
    await fleet.close()
    assert model.engine.stopped and not model.closed  # whoever loaded it closes it
