"""The engine: continuous batching of admitted requests over one executor.

`loop.Engine` runs the engine thread and ties the parts together; the
scheduler, sampler, stop rules, detokenizer and structured-output masks live
in their own modules beside it. The engine speaks plain data (token ids,
counts, finish reasons) and raises `lockgate.errors` classes; only the
server's protocol layer speaks OpenAI.
"""

from lockgate.engine.loop import Delta, Engine, EngineObserver, RequestHandle, Usage
from lockgate.engine.options import EngineOptions
from lockgate.engine.work import Work

__all__ = ["Delta", "Engine", "EngineObserver", "EngineOptions", "RequestHandle", "Usage", "Work"]
