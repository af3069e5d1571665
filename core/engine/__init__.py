"""The engine: continuous batching of admitted requests over one executor.

* `loop.Engine` runs the engine thread: admission checks, executor calls,
  failure isolation, the one path that retires a request, delivery;
* `scheduler.Scheduler` decides what each step runs and owns KV page
  accounting (admission, chunked prefill, preemption, forks);
* `sampling` chooses tokens, `stop.StopChecker` ends choices,
  `detokenizer` turns tokens into text, `structured` masks tokens to a
  grammar;
* `handle.RequestHandle` is what the event loop reads deltas from;
* `client` is the seam the server speaks: the `EngineClient` and `Handle`
  protocols that this engine and engines elsewhere (plugins) implement, and
  `EngineStats`.

The engine speaks plain data (token ids, counts, finish reasons) and raises
`lockgate.errors` classes naming a `subject`; only the server's protocol
layer speaks OpenAI.
"""

from lockgate.engine.client import EngineClient, EngineStats, Handle
from lockgate.engine.handle import Delta, EngineObserver, RequestHandle, Usage
from lockgate.engine.loop import Engine
from lockgate.engine.options import EngineOptions
from lockgate.engine.work import Work

__all__ = [
    "Delta", "Engine", "EngineClient", "EngineObserver", "EngineOptions", "EngineStats", "Handle", "RequestHandle",
    "Usage", "Work",
]
