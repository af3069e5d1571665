"""The built-in `tvm` executor plugin.

Importing TVM costs about 190 MiB and a few seconds, so this module only
registers a factory; TVM is imported when an executor is actually created.
"""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl


def create_executor(model_file, options):
    """Create a `TVMExecutor` (see `lockgate.plugins.tvm.executor`)."""
    from lockgate.plugins.tvm.executor import create_executor as create

    return create(model_file, options)


@hookimpl
def lockgate_register_executors(register):
    register("tvm", create_executor)
