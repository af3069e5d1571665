"""The seam between the server and whatever runs requests: `EngineClient`
and `Handle`, the protocols both the in-process `Engine` and engines that
run elsewhere (the Ray plugin's replicas) implement, and `EngineStats`,
their figures.

The server, the pipeline and the metrics speak only these; an engine plugin
(`lockgate_register_engines`) returns an `EngineClient`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from lockgate.engine.handle import Delta, EngineObserver, Usage
from lockgate.engine.work import Work

#: the figures every engine reports, as /health and the gauges name them
LOAD_FIGURES = (
    "requests_running",
    "requests_waiting",
    "kv_pages_total",
    "kv_pages_used",
    "kv_pages_cached",
    "prefix_cache_sequences",
)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """An engine's load and KV cache figures; where it runs on replicas, the
    sums and each replica's own."""

    requests_running: int = 0
    requests_waiting: int = 0
    kv_pages_total: int = 0
    #: pages requests hold (those only the prefix cache holds are free to evict)
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    prefix_cache_sequences: int = 0
    #: what the weights run as (`Executor.load_report`), where the executor says
    weights: dict[str, Any] | None = None
    #: bytes the executor allocated (`Executor.memory`: weights, kv_cache), where it says
    memory: dict[str, int] | None = None
    #: each replica's figures by replica id, where the engine has replicas
    replicas: dict[str, "EngineStats"] | None = None
    #: further figures an engine reports as they are (a replica's health, pid)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def figure(self, name: str) -> int:
        """One of `LOAD_FIGURES` by name."""
        if name not in LOAD_FIGURES:
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self) -> dict[str, Any]:
        """JSON for /health and the replicas' board: the figures, the extra
        ones, then "weights", "memory" and "replicas" where there are any."""
        out: dict[str, Any] = {name: getattr(self, name) for name in LOAD_FIGURES}
        out.update(self.extra)
        if self.weights is not None:
            out["weights"] = self.weights
        if self.memory is not None:
            out["memory"] = self.memory
        if self.replicas is not None:
            out["replicas"] = {replica: stats.as_dict() for replica, stats in sorted(self.replicas.items())}
        return out

    @classmethod
    def from_dict(cls, figures: dict[str, Any]) -> "EngineStats":
        """The inverse of `as_dict` (a replica's post read back)."""
        replicas = figures.get("replicas")
        return cls(
            **{name: int(figures.get(name, 0)) for name in LOAD_FIGURES},
            weights=figures.get("weights"),
            memory=figures.get("memory"),
            replicas=None if replicas is None else {r: cls.from_dict(f) for r, f in replicas.items()},
            extra={k: v for k, v in figures.items() if k not in (*LOAD_FIGURES, "weights", "memory", "replicas")},
        )

    @classmethod
    def summed(cls, replicas: dict[str, "EngineStats"]) -> "EngineStats":
        """The figures of several replicas added up, each kept under `replicas`."""
        totals = {name: sum(stats.figure(name) for stats in replicas.values()) for name in LOAD_FIGURES}
        return cls(**totals, replicas=dict(replicas))


@runtime_checkable
class Handle(Protocol):
    """One admitted request as the event loop sees it: an async iterator of
    `Delta` that raises the error the request failed with, or a callback
    fed the same (`subscribe`)."""

    #: what was enqueued: the prompt's token ids and the sampling parameters
    work: Work
    #: choices the request generates
    n: int
    #: token counts, complete once the last delta is read
    usage: Usage
    #: where the request runs, where there is a choice (the `x-lockgate-replica`
    #: header); None in process
    replica: str | None

    def __aiter__(self): ...

    async def __anext__(self) -> Delta: ...

    def subscribe(self, callback: Callable[[Delta | BaseException | None], None]) -> None:
        """Deliver each delta to `callback` instead of iteration, then None
        when the request ends or the exception it failed with (a handle read
        only by iteration gets this from `IteratedHandle`)."""

    def abort(self) -> None:
        """Stop generating; the request's KV pages are freed."""


class IteratedHandle:
    """A base for handles whose deltas are read by iteration (an engine
    elsewhere streams them): `subscribe` reads the handle in a task and
    feeds the callback; a subclass's `abort` calls `stop_reading`."""

    replica: str | None = None
    _reader: asyncio.Future | None = None

    def __aiter__(self):
        return self

    def subscribe(self, callback: Callable[[Delta | BaseException | None], None]) -> None:
        async def read() -> None:
            try:
                async for delta in self:
                    callback(delta)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                callback(exc)
            else:
                callback(None)

        self._reader = asyncio.ensure_future(read())

    def stop_reading(self) -> None:
        """End `subscribe`'s task (from any thread)."""
        if self._reader is not None and not self._reader.done():
            self._reader.get_loop().call_soon_threadsafe(self._reader.cancel)


@runtime_checkable
class EngineClient(Protocol):
    """What serves a model's requests: `lockgate.engine.Engine` in this
    process, or an engine plugin's (`lockgate_register_engines`)."""

    name: str
    #: the most tokens one sequence may hold, prompt and output together
    context_length: int
    #: told of finished requests, preemptions and prefix lookups (metrics)
    observer: EngineObserver
    #: why the engine cannot serve, or None
    unhealthy_reason: str | None

    @property
    def max_n(self) -> int:
        """The most choices one request may ask for."""

    @property
    def healthy(self) -> bool: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin serving; deltas are delivered on `loop`."""

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop: requests still running after `grace_seconds` fail with 503."""

    def close(self) -> None:
        """Release what the engine holds beyond the executor (replicas)."""

    def add(self, work: Work) -> Handle:
        """Admit `work` or raise why not (a `lockgate.errors` class)."""

    def stats(self) -> EngineStats: ...


def conformance_problems(implementation: object, protocol: type) -> list[str]:
    """What `implementation` (an object, or a class) lacks of `protocol` (a
    `Protocol` such as `EngineClient` or `Handle`, or an ABC such as
    `Executor`): each method it does not have, each method whose
    parameters do not take the protocol's by name, and, for an object, each
    property and declared attribute it does not hold. Empty when it
    conforms. `isinstance` against a runtime-checkable protocol only looks
    for names; this compares the calls."""
    problems = []
    is_class = isinstance(implementation, type)
    cls = implementation if is_class else type(implementation)
    for name, member in vars(protocol).items():
        if name.startswith("_") and name not in ("__aiter__", "__anext__"):
            continue
        if not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        # an object's own lookup (a wrapper may delegate through __getattr__)
        own = inspect.getattr_static(cls, name, None) if is_class else getattr(implementation, name, None)
        if isinstance(member, property):
            # a property may be an attribute each instance sets: checked on objects
            if not is_class and not hasattr(implementation, name):
                problems.append(f"{cls.__name__} has no {name}")
        elif own is None:
            problems.append(f"{cls.__name__} has no {name}")
        elif callable(own) or isinstance(own, (staticmethod, classmethod)):
            problems.extend(_signature_problems(cls, name, member, getattr(implementation, name)))
        else:
            problems.append(f"{cls.__name__}.{name} is not a method")
    if not is_class:
        for name in getattr(protocol, "__annotations__", {}):
            if not hasattr(implementation, name):
                problems.append(f"{cls.__name__} has no attribute {name}")
    return problems


def _signature_problems(cls: type, name: str, declared, implemented) -> list[str]:
    try:
        wanted = inspect.signature(declared).parameters
        given = inspect.signature(implemented).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    takes_any = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in given.values())
    missing = [p for p in wanted if p not in given and p != "self"]
    if missing and not takes_any:
        return [f"{cls.__name__}.{name} does not take {', '.join(missing)}"]
    extra = [p for p, value in given.items() if p not in wanted and value.default is value.empty
             and value.kind not in (value.VAR_POSITIONAL, value.VAR_KEYWORD)]
    return [f"{cls.__name__}.{name} requires {', '.join(extra)}, which callers do not pass"] if extra else []
