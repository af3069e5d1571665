"""Settings: defaults, LOCKGATE_* variables, CLI flags over both."""

from __future__ import annotations

from pathlib import Path

from lockgate.server.config import Settings, serve_parser, settings_from_args


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
    assert Settings.from_env({}).model == "SmolLM2-135M-Instruct"


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
    from lockgate.models.executor import ExecutorOptions

    assert Settings().engine_options() == EngineOptions()
    assert Settings().executor_options() == ExecutorOptions()


def test_a_no_flag_overrides_a_true_variable(monkeypatch):
    monkeypatch.setenv("LOCKGATE_METRICS_PUBLIC", "yes")
    assert settings_from_args(serve_parser().parse_args([])).metrics_public is True
    assert settings_from_args(serve_parser().parse_args(["--no-metrics-public"])).metrics_public is False


def test_text_overrides_parse_like_variables():
    settings = Settings.from_env({}, api_keys="a,b", cache_dir="/tmp/c", port="9003")
    assert settings.api_keys == ("a", "b")
    assert settings.cache_dir == Path("/tmp/c")
    assert settings.port == 9003
