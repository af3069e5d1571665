"""Built-in `lockgate_enqueue`: hand the work to the engine (which may raise)."""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl


@hookimpl(trylast=True)
def lockgate_enqueue(work, engine):
    return engine.add(work)
