"""Every engine and executor lockgate ships, and the test doubles the suite
runs in their place, against the interfaces the server and the engine call
(`conformance_problems`: the methods and their parameters, not only the
names a runtime-checkable protocol looks for); and the loader refuses an
engine or executor plugin that does not conform, at start-up."""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor
from scripted_executor import ScriptedExecutor
from zero_cost_executor import ZeroCostExecutor

from lockgate import hookimpl
from lockgate.engine import Engine, EngineClient, Handle, RequestHandle
from lockgate.engine.client import conformance_problems
from lockgate.engine.executor import Executor
from lockgate.errors import ModelLoadError
from lockgate.models.loading import load_served_model, registered_engines, registered_executors
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugins.process.engine import ChildEngine, ChildRequestHandle
from lockgate.plugins.ray.engine import RayEngine, RemoteRequestHandle
from lockgate.plugins.tvm.executor import TVMExecutor
from lockgate.server.config import Settings

#: each class that stands for an interface: the built-ins and the suite's doubles
IMPLEMENTATIONS = [
    (Engine, EngineClient), (RayEngine, EngineClient), (ChildEngine, EngineClient),
    (RequestHandle, Handle), (RemoteRequestHandle, Handle), (ChildRequestHandle, Handle),
    (TVMExecutor, Executor), (FakeExecutor, Executor), (ScriptedExecutor, Executor), (ZeroCostExecutor, Executor),
]


@pytest.mark.parametrize("implementation, interface", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_conforms(implementation, interface):
    assert conformance_problems(implementation, interface) == []


def test_every_registered_engine_and_executor_is_checked_here():
    pm = get_plugin_manager(autoload=False)
    assert set(registered_engines(pm)) == {"local", "ray", "process"}  # Engine, RayEngine, ChildEngine above
    assert set(registered_executors(pm)) == {"tvm"}  # TVMExecutor above


class Lacking:
    """Names an engine must have, some missing, one with a wrong call."""

    name = "lacking"
    context_length = 16

    def start(self):  # no loop parameter
        ...

    def add(self, work, priority):  # a parameter no caller passes
        ...


def test_what_does_not_conform_is_named():
    problems = conformance_problems(Lacking(), EngineClient)
    assert "Lacking.start does not take loop" in problems
    assert "Lacking.add requires priority, which callers do not pass" in problems
    assert {"Lacking has no stats", "Lacking has no max_n", "Lacking has no attribute observer"} <= set(problems)
    assert conformance_problems(Lacking, EngineClient)  # the class alone is found lacking too


def test_the_loader_refuses_an_engine_plugin_that_does_not_conform():
    closed = []

    class Loaded:
        engine = Lacking()

        def close(self):
            closed.append(True)

    class Plugin:
        @hookimpl
        def lockgate_register_engines(self, register):
            register("lacking", lambda pm, settings, progress: Loaded())

    pm = get_plugin_manager(autoload=False, plugins=[Plugin()])
    with pytest.raises(ModelLoadError, match="engine 'lacking' does not implement EngineClient: .*start does not take"):
        load_served_model(pm, Settings(engine="lacking"))
    assert closed == [True]  # what it loaded is released


def test_a_loader_without_reserve_loads_but_not_under_a_memory_budget():
    calls = []

    class Plugin:
        @hookimpl
        def lockgate_register_engines(self, register):
            # written before `reserve=` existed
            register("older", lambda pm, settings, progress: calls.append(settings.model_source))

    pm = get_plugin_manager(autoload=False, plugins=[Plugin()])
    with pytest.raises(ModelLoadError, match="'older' cannot keep to a memory budget"):
        load_served_model(pm, Settings(engine="older", model="m.gguf"), reserve=lambda memory: None)
    assert calls == []  # refused before it loaded anything
    with pytest.raises(AttributeError):  # called without one (and returns nothing a server could serve)
        load_served_model(pm, Settings(engine="older", model="m.gguf"))
    assert calls == ["m.gguf"]
