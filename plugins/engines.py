"""Built-in `lockgate_register_engines`: `local`, continuous batching in
this process (`lockgate.engine.Engine` over the executor `--executor`
names). The Ray plugin (`lockgate.plugins.ray`) registers `ray`."""

from __future__ import annotations

from lockgate.models import load_model_from_settings
from lockgate.plugin_api.hookspecs import hookimpl


@hookimpl
def lockgate_register_engines(register):
    register("local", load_model_from_settings)
