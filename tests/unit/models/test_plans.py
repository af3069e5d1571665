"""Which models a server serves and with what settings (`model_plans`):
`--model NAME=MODEL`, a models folder, a preset file, and what each is
refused for."""

from __future__ import annotations

import pytest

from lockgate.errors import ModelLoadError
from lockgate.models.plans import SEVERAL_MODELS_ENGINE, model_plans
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.server.config import Settings
from lockgate.settings import InvalidSetting, settings_table


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager(autoload=False)


@pytest.fixture
def m(tmp_path):
    """Files by name in a folder (empty: only their being there is read)."""
    def made(name: str) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return str(path)

    return made


def plans_of(pm, **values):
    settings = Settings(**values)
    return {plan.name: plan for plan in model_plans(settings, pm, settings_table(pm))}


def test_no_model_named_serves_the_default_one_in_process_loaded_at_start(pm):
    plans = plans_of(pm)
    [plan] = plans.values()
    assert plan.name == "SmolLM2-135M-Instruct" and "smollm2" in plan.aliases
    assert plan.pinned and plan.settings.engine is None
    assert plan.settings.model_source == "SmolLM2-135M-Instruct"


def test_one_model_with_a_ttl_is_not_pinned(pm, m):
    [plan] = plans_of(pm, model=(m("m.gguf"),), idle_ttl=30.0).values()
    assert plan.name == "m" and not plan.pinned and plan.idle_ttl == 30.0


def test_several_models_each_run_in_a_process_of_their_own_loaded_on_first_use(pm, m):
    qwen, nomic = m("qwen.gguf"), m("nomic-embed.gguf")
    plans = plans_of(pm, model=(f"chat={qwen}", nomic), max_total_tokens=1024)
    assert set(plans) == {"chat", "nomic-embed"}
    for plan in plans.values():
        assert plan.settings.engine == SEVERAL_MODELS_ENGINE and not plan.pinned
        assert plan.settings.max_total_tokens == 1024
        assert plan.settings.served_model_name == plan.name
    assert plans["chat"].settings.model_source == qwen
    # an engine named keeps its say, and so does a setting that chooses one
    two = (f"a={qwen}", f"b={nomic}")
    assert all(p.settings.engine == "local" for p in plans_of(pm, model=two, engine="local").values())
    replicated = Settings.of(model=two, replicas="2")
    assert all(p.settings.engine is None and p.settings.replicas == "2"
               for p in model_plans(replicated, pm, settings_table(pm)))


def test_two_models_of_one_name_are_refused(pm, m):
    with pytest.raises(InvalidSetting, match="two models are named 'm'"):
        plans_of(pm, model=(m("x/m.gguf"), m("y/m.gguf")))
    with pytest.raises(InvalidSetting, match="--served-model-name names one model"):
        plans_of(pm, model=(f"a={m('a.gguf')}", f"b={m('b.gguf')}"), served_model_name="c")


def test_a_model_that_is_not_there_stops_start_up(pm, m, tmp_path):
    with pytest.raises(ModelLoadError, match="'/nowhere/b.gguf' is neither a registered model"):
        plans_of(pm, model=(f"a={m('a.gguf')}", "b=/nowhere/b.gguf"))


def test_a_models_folder(pm, tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    hf = tmp_path / "b-hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    plans = plans_of(pm, models_dir=tmp_path)
    assert set(plans) == {"a", "b-hf"}
    assert plans["a"].path == tmp_path / "a.gguf"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="holds no GGUF file"):
        plans_of(pm, models_dir=empty)


PRESET = """
[models.chat]
model = "{qwen}"
max_total_tokens = 16384
quantize = "q8_0"
pinned = true
aliases = ["assistant"]

[models.embed]
model = "{nomic}"
pooling = "mean"
idle_ttl = 600
rerank_tokens = ["yes", "no"]
"""


def test_a_preset_sets_each_models_settings(pm, tmp_path, m):
    preset = tmp_path / "models.toml"
    preset.write_text(PRESET.replace("{qwen}", m("qwen.gguf")).replace("{nomic}", m("nomic.gguf")))
    plans = plans_of(pm, models_preset=preset, max_total_tokens=2048)
    chat, embed = plans["chat"], plans["embed"]
    assert chat.pinned and chat.aliases == ("assistant",) and chat.idle_ttl is None
    assert chat.settings.max_total_tokens == 16384 and chat.settings.quantize == "q8_0"
    assert embed.settings.max_total_tokens == 2048  # the server's, where the preset says nothing
    assert embed.settings.pooling == "mean" and embed.idle_ttl == 600.0 and not embed.pinned
    assert embed.settings.rerank_tokens == ("yes", "no")


@pytest.mark.parametrize("table, message", [
    ('[models.a]\nmodel = "/a.gguf"\nport = 9000', "models.a.port is a setting of the whole server"),
    ('[models.a]\nmodel = "/a.gguf"\ncolour = "red"', "models.a.colour: no setting has that name"),
    ('[models.a]\nmodel = "/a.gguf"\nmax_total_tokens = "many"', "models.a.max_total_tokens must be an integer"),
    ('[models.a]\nmodel = "/a.gguf"\nmax_total_tokens = 1.5', "models.a.max_total_tokens must be int"),
    ('[models.a]\nmodel = "/a.gguf"\npinned = "yes"', "models.a.pinned must be true or false"),
    ('[models.a]\nmax_total_tokens = 64', "models.a needs `model`"),
    ('[models.a]\nmodel = "/a.gguf"\naliases = "b"', "models.a.aliases must be a list"),
    ('[servers.a]\nmodel = "/a.gguf"', "unknown table or key 'servers'"),
    ('[models]', "has no [models.NAME] table"),
    ('[models.a\nmodel = 1', "is not TOML"),
])
def test_a_preset_that_does_not_read_is_refused_naming_the_key(pm, tmp_path, table, message):
    preset = tmp_path / "models.toml"
    (tmp_path / "a.gguf").write_bytes(b"")
    preset.write_text(table.replace('"/a.gguf"', f'"{tmp_path / "a.gguf"}"'))
    with pytest.raises(InvalidSetting, match=message.replace("[", r"\[").replace(".", r"\.")):
        plans_of(pm, models_preset=preset)


def test_a_missing_preset_is_refused(pm, tmp_path):
    with pytest.raises(InvalidSetting, match="No such file"):
        plans_of(pm, models_preset=tmp_path / "absent.toml")
