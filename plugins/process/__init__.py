"""A model's engine in a child process of its own: the engine `process`
(`lockgate_register_engines`; `--engine process`, and the default for each
model of a server that serves several).

The front keeps HTTP, the plugin pipeline and the model's tokenizer; the
child loads the executor and runs the same `Engine` a single-process
server runs, and the two speak `lockgate.engine.wire` over a pipe. So an
unloaded model's memory goes back to the system with its process, and a
native crash in one model fails that model's requests alone (503) while
the front and the other models go on serving.

* `engine` — the front's side (`ChildEngine`, an `EngineClient`);
* `child` — the child process's side (`run_child`).
"""

from __future__ import annotations

import pluggy

from lockgate.models import Model, open_model
from lockgate.models.loading import source_options
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.manager import plugin_recipe


@hookimpl
def lockgate_register_engines(register):
    register("process", serve_in_child)


def serve_in_child(pm: pluggy.PluginManager, settings, progress=None, reserve=None) -> Model:
    """The model `settings` names: its tokenizer read here, its executor and
    engine loaded in a new child process. Returns once the child serves;
    raises `ModelLoadError` with the child's reason (or its exit code) when
    it does not. `reserve` is called here with what the child's executor is
    about to allocate; the child waits for it. `Model.close()` ends the
    child."""
    from lockgate.plugins.process.engine import ChildEngine

    source = open_model(pm, settings.model_source, progress=progress, **source_options(settings))
    source.metadata = None
    engine = ChildEngine.launch(source.name, settings, plugin_recipe(pm), progress=progress, reserve=reserve)
    return source.serve_with(engine)
