"""Settings: defaults, LOCKGATE_* variables, CLI flags over both."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate import hookimpl
from lockgate.models.loading import chosen_engine, registered_engines
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.server.config import Settings, serve_parser, settings_from_args
from lockgate.settings import InvalidSetting, Setting, settings_table


def test_environment_overrides_defaults():
    settings = Settings.from_env(
        {
            "LOCKGATE_PORT": "9001",
            "LOCKGATE_MAX_NUM_BATCHED_TOKENS": "64",
            "LOCKGATE_SHUTDOWN_GRACE": "2.5",
            "LOCKGATE_CACHE_DIR": "/tmp/c",
            "LOCKGATE_API_KEY": "a, b",
        }
    )
    assert settings.port == 9001
    assert settings.max_num_batched_tokens == 64
    assert settings.shutdown_grace == 2.5
    assert settings.cache_dir == Path("/tmp/c")
    assert settings.api_keys == ("a", "b")
    assert Settings.from_env({}).model == ()
    assert Settings.from_env({}).model_source == "SmolLM2-135M-Instruct"


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("LOCKGATE_PORT", "9001")
    monkeypatch.setenv("LOCKGATE_MAX_QUEUE", "3")
    args = serve_parser().parse_args(["--port", "9002", "--api-key", "k1,k2", "--max-num-seqs", "4"])
    settings = settings_from_args(args)
    assert settings.port == 9002
    assert settings.max_queue == 3
    assert settings.api_keys == ("k1", "k2")
    assert settings.engine_options().max_queue == 3
    assert settings.executor_options().max_num_seqs == 4


def test_options_defaults_come_from_the_settings_table():
    from lockgate.engine import EngineOptions
    from lockgate.engine.executor import ExecutorOptions

    assert Settings().engine_options() == EngineOptions()
    assert Settings().executor_options() == ExecutorOptions()


def test_a_plugins_settings_are_flags_variables_and_attributes(monkeypatch):
    """The TVM and Ray plugins add theirs (`lockgate_add_settings`): flags,
    `LOCKGATE_*` variables, attributes of `Settings` (their defaults when
    not given), and the executor's `plugin_settings`."""
    assert Settings().target == "auto" and Settings().replicas is None
    monkeypatch.setenv("LOCKGATE_TARGET", "llvm")
    settings = settings_from_args(serve_parser().parse_args(["--num-threads", "3", "--replicas", "2"]))
    assert (settings.target, settings.num_threads, settings.replicas) == ("llvm", 3, "2")
    assert {k: settings.plugins[k] for k in ("target", "num_threads", "replicas", "cache_dir")} == {
        "target": "llvm", "num_threads": 3, "replicas": "2", "cache_dir": None}
    assert settings.executor_options().plugin_settings == settings.plugins
    engines = registered_engines(get_plugin_manager(autoload=False))
    assert chosen_engine(settings, engines) == "ray"
    assert chosen_engine(settings.replaced(replicas=None), engines) == "local"
    assert chosen_engine(settings.replaced(engine="local"), engines) == "local"
    with pytest.raises(AttributeError):
        Settings().no_such_setting


def test_a_no_flag_overrides_a_true_variable(monkeypatch):
    monkeypatch.setenv("LOCKGATE_METRICS_PUBLIC", "yes")
    assert settings_from_args(serve_parser().parse_args([])).metrics_public is True
    assert settings_from_args(serve_parser().parse_args(["--no-metrics-public"])).metrics_public is False


def test_text_overrides_parse_like_variables():
    settings = Settings.from_env({}, api_keys="a,b", cache_dir="/tmp/c", port="9003")
    assert settings.api_keys == ("a", "b")
    assert settings.cache_dir == Path("/tmp/c")
    assert settings.port == 9003


class TeapotSettings:
    @hookimpl
    def lockgate_add_settings(self, register):
        register(Setting("teapot_strength", int, 3, "how strong the tea is brewed"))


def test_a_third_party_plugin_adds_a_setting(monkeypatch):
    pm = get_plugin_manager(autoload=False, plugins=[TeapotSettings()])
    assert settings_table(pm)[-1].name == "teapot_strength"  # after the built-ins' own
    assert "--teapot-strength" in serve_parser(pm=pm).format_help()
    assert settings_from_args(serve_parser(pm=pm).parse_args([]), pm).teapot_strength == 3
    assert settings_from_args(serve_parser(pm=pm).parse_args(["--teapot-strength", "5"]), pm).teapot_strength == 5
    monkeypatch.setenv("LOCKGATE_TEAPOT_STRENGTH", "7")
    settings = settings_from_args(serve_parser(pm=pm).parse_args([]), pm)
    assert settings.teapot_strength == 7 and settings.executor_options().plugin_settings["teapot_strength"] == 7


class TakenName:
    @hookimpl
    def lockgate_add_settings(self, register):
        register(Setting("port", int, 1, "a second port"))


def test_a_plugin_setting_may_not_take_a_name():
    with pytest.raises(InvalidSetting, match="'port'.*taken"):
        settings_table(get_plugin_manager(autoload=False, plugins=[TakenName()]))
