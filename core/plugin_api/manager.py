"""Building the plugin manager: built-in plugins, entry points, environment switches."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import threading
import time
import types
from collections.abc import Callable, Iterable

import pluggy
import structlog

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
    "lockgate.plugins.engines",
    "lockgate.plugins.tool_formats",
    "lockgate.plugins.reasoning_formats",
    "lockgate.plugins.drafters",
    "lockgate.plugins.tvm",
    "lockgate.plugins.ray",
    "lockgate.plugins.process",
)

DISABLED_PLUGINS_ENV = "LOCKGATE_DISABLED_PLUGINS"
DISABLE_AUTOLOAD_ENV = "LOCKGATE_DISABLE_PLUGIN_AUTOLOAD"
TRACE_PLUGINS_ENV = "LOCKGATE_TRACE_PLUGINS"
#: modules registered as plugins without an entry point (pytest's `PYTEST_PLUGINS`)
PLUGINS_ENV = "LOCKGATE_PLUGINS"

#: Built-ins without which every request fails, so `LOCKGATE_DISABLED_PLUGINS`
#: may not name them: name -> (the hook a plugin implements instead, why).
REQUIRED_PLUGINS = {
    "errors": (
        "lockgate_handle_exception",
        "it answers errors in OpenAI's shape, and without it every error, a 400 "
        "included, becomes a 500",
    ),
    "enqueue": (
        "lockgate_enqueue",
        "it hands each request to the engine, and without it every request fails with a 500",
    ),
}
#: Built-ins that may be blocked only while another plugin implements their
#: hook: name -> hook.
REPLACEABLE_PLUGINS = {
    "template": "lockgate_render_prompt",
    "tokenize": "lockgate_tokenize",
}

trace_log = structlog.get_logger("lockgate.plugins")


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that refuses `async def` hook implementations.

    pluggy never awaits: a coroutine function would return an un-awaited
    coroutine, which wins every firstresult call and does nothing.
    """

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None:
            return None
        function = getattr(plugin, name)
        if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            plugin_name = getattr(plugin, "__name__", type(plugin).__name__)
            raise PluginError(
                f"plugin {plugin_name!r}: hook {name} is `async def`, but lockgate hooks must be "
                "plain functions: pluggy never awaits, so the coroutine would go un-run and win "
                "every first-result hook. Write it as a plain `def`: the request pipeline's "
                "hooks run in a worker thread, so they may block."
            )
        return opts


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLED_PLUGINS_ENV, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def _refuse_required(disabled: set[str]) -> None:
    refused = sorted(disabled & REQUIRED_PLUGINS.keys())
    if refused:
        name = refused[0]
        hook, why = REQUIRED_PLUGINS[name]
        raise PluginError(
            f"{DISABLED_PLUGINS_ENV} names {name!r}, a built-in plugin that cannot be disabled: "
            f"{why}. Remove {name!r} from {DISABLED_PLUGINS_ENV}. To change what it does, "
            f"implement {hook} in a plugin of your own: built-ins run last, so yours answers first."
        )


def _refuse_unreplaced(pm: pluggy.PluginManager, disabled: set[str]) -> None:
    for name in sorted(disabled & REPLACEABLE_PLUGINS.keys()):
        hook = REPLACEABLE_PLUGINS[name]
        answering = [
            impl for impl in getattr(pm.hook, hook).get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper)
        ]
        if not answering:
            raise PluginError(
                f"{DISABLED_PLUGINS_ENV} names {name!r}, but no other plugin implements {hook}: "
                f"without one every request would fail with a 500. Install (or register) a plugin that "
                f"implements {hook}, or remove {name!r} from {DISABLED_PLUGINS_ENV} (a plugin's "
                f"{hook} answers before the built-in's, so blocking it is rarely needed)."
            )


def trace_hook_calls(pm: pluggy.PluginManager) -> Callable[[], None]:
    """Log every hook call on `pm`: one "hook call" line on the "lockgate.plugins"
    logger with `hook`, `plugins` (the implementations pluggy was handed, in
    the order it calls them; a first-result hook stops at the first non-None
    answer), `duration_ms`, and `error` (the exception's type name) when the
    call raised. Returns a function that stops the tracing.
    """
    # before/after of one call run on one thread, nested calls inside it
    starts = threading.local()

    def before(hook_name, hook_impls, kwargs) -> None:
        if not hasattr(starts, "stack"):
            starts.stack = []
        starts.stack.append(time.perf_counter())

    def after(outcome, hook_name, hook_impls, kwargs) -> None:
        duration_ms = (time.perf_counter() - starts.stack.pop()) * 1000
        fields: dict[str, object] = {
            "hook": hook_name,
            "plugins": [impl.plugin_name for impl in reversed(hook_impls)],
            "duration_ms": round(duration_ms, 3),
        }
        if outcome.exception is not None:
            fields["error"] = type(outcome.exception).__name__
        trace_log.info("hook call", **fields)

    return pm.add_hookcall_monitoring(before, after)


def get_plugin_manager(*, autoload: bool = True, plugins: Iterable[object] = ()) -> PluginManager:
    """Build a plugin manager with lockgate's hooks.

    Registers the built-in plugins, then (unless `autoload` is False or
    `LOCKGATE_DISABLE_PLUGIN_AUTOLOAD` is set) the `lockgate` entry points, then
    the modules named in `LOCKGATE_PLUGINS` (comma separated, importable
    names: a plugin that is not packaged, or one that must also load in Ray
    replicas, which inherit the variable), then `plugins` (modules, classes
    or instances, for tests and embedding). Names
    in `LOCKGATE_DISABLED_PLUGINS` (comma separated: a built-in's short name
    such as "validate" or an entry point's name) are blocked.
    `LOCKGATE_TRACE_PLUGINS=1` logs every hook call (`trace_hook_calls`).

    :raises PluginError: a plugin has an `async def` hook; or
        `LOCKGATE_DISABLED_PLUGINS` names `errors` or `enqueue`, or names
        `template` or `tokenize` while no other plugin implements their hook
        (without them every request would fail).
    :raises pluggy.PluginValidationError: a plugin implements a hook that
        does not exist, or takes an argument its hook does not pass.
    """
    disabled = _disabled_names()
    # refused before any third-party code is imported
    _refuse_required(disabled)
    pm = PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    for module_name in DEFAULT_PLUGINS:
        short_name = module_name.rsplit(".", 1)[1]
        if pm.is_blocked(short_name):
            continue
        pm.register(importlib.import_module(module_name), name=short_name)
    if autoload and not os.environ.get(DISABLE_AUTOLOAD_ENV):
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for module_name in _named_plugin_modules():
        if pm.get_plugin(module_name) is None and not pm.is_blocked(module_name):
            pm.register(_import_plugin(module_name), name=module_name)
    plugins = list(plugins)
    for plugin in plugins:
        pm.register(plugin)
    pm.recipe = PluginRecipe(autoload, tuple(p.__name__ for p in plugins if isinstance(p, types.ModuleType)))
    pm.check_pending()
    _refuse_unreplaced(pm, disabled)
    if os.environ.get(TRACE_PLUGINS_ENV, "") not in ("", "0"):
        trace_hook_calls(pm)
    return pm


@dataclasses.dataclass(frozen=True)
class PluginRecipe:
    """How a plugin manager was built, for another process to build the
    same (a model's child process): whether entry points were loaded, and
    the plugin modules given by name. Plugins given as classes or objects
    do not cross; the environment (`LOCKGATE_PLUGINS`, ...) is inherited."""

    autoload: bool = True
    modules: tuple[str, ...] = ()

    def build(self) -> PluginManager:
        return get_plugin_manager(autoload=self.autoload,
                                  plugins=[importlib.import_module(name) for name in self.modules])


def plugin_recipe(pm: pluggy.PluginManager) -> PluginRecipe:
    """How `pm` was built (`get_plugin_manager` records it); a manager built
    otherwise is taken as the default one."""
    return getattr(pm, "recipe", PluginRecipe())


def _named_plugin_modules() -> list[str]:
    return [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]


def _import_plugin(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{PLUGINS_ENV} names {module_name!r}, which cannot be imported: {exc}") from None


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

