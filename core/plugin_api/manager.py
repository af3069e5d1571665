"""Building the plugin manager: built-in plugins, entry points, environment switches."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable

import pluggy

from lockgate.plugin_api import hookspecs
from lockgate.errors import PluginError

ENTRY_POINT_GROUP = "lockgate"

#: Built-in plugins, registered exactly like third-party ones. The name a
#: module is registered under is its last dotted part ("validate", "tvm", ...),
#: which is what `LOCKGATE_DISABLED_PLUGINS` takes.
DEFAULT_PLUGINS = (
    "lockgate.plugins.validate",
    "lockgate.plugins.template",
    "lockgate.plugins.tokenize",
    "lockgate.plugins.enqueue",
    "lockgate.plugins.errors",
    "lockgate.plugins.models",
    "lockgate.plugins.tvm",
)

DISABLED_PLUGINS_ENV = "LOCKGATE_DISABLED_PLUGINS"
DISABLE_AUTOLOAD_ENV = "LOCKGATE_DISABLE_PLUGIN_AUTOLOAD"


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that refuses `async def` hook implementations.

    pluggy never awaits: a coroutine function would return an un-awaited
    coroutine, which wins every firstresult call and does nothing.
    """

    def register(self, plugin, name=None):
        for attr_name in dir(plugin):
            if not attr_name.startswith("lockgate_"):
                continue
            attr = getattr(plugin, attr_name, None)
            if inspect.iscoroutinefunction(attr) or inspect.isasyncgenfunction(attr):
                plugin_name = name or getattr(plugin, "__name__", repr(plugin))
                raise PluginError(
                    f"plugin {plugin_name!r}: hook {attr_name} is async; lockgate hooks "
                    "must be plain functions (they run in a worker thread)"
                )
        return super().register(plugin, name)


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLED_PLUGINS_ENV, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def get_plugin_manager(*, autoload: bool = True, plugins: Iterable[object] = ()) -> PluginManager:
    """Build a plugin manager with lockgate's hooks.

    Registers the built-in plugins, then (unless `autoload` is False or
    `LOCKGATE_DISABLE_PLUGIN_AUTOLOAD` is set) the `lockgate` entry points, then
    `plugins` (modules, classes or instances, for tests and embedding). Names
    in `LOCKGATE_DISABLED_PLUGINS` (comma separated: a built-in's short name
    such as "validate" or an entry point's name) are blocked.
    """
    pm = PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in _disabled_names():
        pm.set_blocked(name)
    for module_name in DEFAULT_PLUGINS:
        short_name = module_name.rsplit(".", 1)[1]
        if pm.is_blocked(short_name):
            continue
        pm.register(importlib.import_module(module_name), name=short_name)
    if autoload and not os.environ.get(DISABLE_AUTOLOAD_ENV):
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


def describe_plugins(pm: pluggy.PluginManager) -> list[dict[str, object]]:
    """Each registered plugin with the hooks it implements, for `lockgate plugins`."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    described = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())
        dist = dists.get(id(plugin))
        described.append(
            {
                "name": name,
                "hooks": hooks,
                "distribution": None if dist is None else f"{dist.project_name} {dist.version}",
            }
        )
    return sorted(described, key=lambda item: str(item["name"]))

