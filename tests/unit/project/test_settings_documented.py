"""The settings table is the one source: docs/configuration.md shows it, and every entry
has a variable and a flag that parse to its type (datasette's
`test_settings_are_documented`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from paths import ROOT
from pathlib import Path

import pytest

from lockgate.server.config import Settings, serve_parser, settings_from_args
from lockgate.settings import SETTINGS, InvalidSetting, Setting, markdown_table, settings_table

#: the server's settings and the built-in plugins'
TABLE = settings_table()

CONFIGURATION = ROOT / "docs" / "configuration.md"
START = "<!-- settings table: python -m lockgate.settings -->\n"
END = "<!-- end of settings table -->\n"


def test_readme_table_is_the_settings_table():
    text = CONFIGURATION.read_text()
    assert START in text and END in text, "docs/configuration.md lost the settings table's markers"
    documented = text[text.index(START) + len(START):text.index(END)]
    assert documented == markdown_table(), "docs/configuration.md is stale: paste `python -m lockgate.settings` between the markers"


def test_settings_fields_are_the_table():
    """The server's settings are fields; the plugins' are held in `plugins`."""
    fields = [f for f in dataclasses.fields(Settings) if f.name != "plugins"]
    assert [f.name for f in fields] == [s.name for s in SETTINGS]
    assert {f.name: f.default for f in fields} == {s.name: s.default for s in SETTINGS}


def test_the_built_in_plugins_add_their_settings():
    added = [s.name for s in TABLE[len(SETTINGS):]]
    assert added == ["target", "quantize", "num_threads", "exact_matmul", "device_sampling", "cache_dir",
                     "replicas", "min_replicas", "max_replicas", "ray_address", "gpus_per_replica",
                     "cpus_per_replica"]


def sample(setting: Setting) -> tuple[str, object]:
    """Text for `setting` and the value it must parse to, other than the default."""
    if setting.is_list:
        return "a, b", ("a", "b")
    if setting.is_bool:
        return ("false", False) if setting.default else ("true", True)
    if setting.choices:
        raw = next(choice for choice in setting.choices if choice != setting.default)
        return raw, raw
    return {
        int: ("7", 7),
        float: ("2.5", 2.5),
        str: ("x", "x"),
        Path: ("/tmp/x", Path("/tmp/x")),
    }[setting.type]


@pytest.mark.parametrize("setting", TABLE, ids=lambda s: s.name)
def test_every_variable_parses_to_the_type(setting):
    raw, value = sample(setting)
    for var in setting.env_vars:
        parsed = getattr(Settings.from_env({var: raw}), setting.name)
        assert parsed == value and type(parsed) is type(value), var


@pytest.mark.parametrize("setting", TABLE, ids=lambda s: s.name)
def test_every_flag_parses_to_the_type(setting):
    raw, value = sample(setting)
    if setting.is_bool:  # the on/off flag that changes the default
        argv = ["--no-" + setting.flag.removeprefix("--")] if setting.default else [setting.flag]
    else:
        argv = [setting.flag, raw]
    parsed = getattr(settings_from_args(serve_parser().parse_args(argv)), setting.name)
    assert parsed == value and type(parsed) is type(value)


def test_api_key_keeps_its_singular_variable_and_flag():
    api_keys = next(s for s in SETTINGS if s.name == "api_keys")
    assert api_keys.flag == "--api-key"
    assert "LOCKGATE_API_KEY" in api_keys.env_vars
    assert Settings.from_env({"LOCKGATE_API_KEY": "k"}).api_keys == ("k",)


@pytest.mark.parametrize(
    "var, raw",
    [
        ("LOCKGATE_PORT", "eighty"),
        ("LOCKGATE_SHUTDOWN_GRACE", "soon"),
        ("LOCKGATE_METRICS_PUBLIC", "maybe"),
        ("LOCKGATE_TARGET", "tpu"),
    ],
)
def test_a_bad_variable_is_named(var, raw):
    with pytest.raises(InvalidSetting, match=f"^{var} .*{raw!r}"):
        Settings.from_env({var: raw})


def test_serve_stops_on_a_bad_variable_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "serve"],
        env={**os.environ, "LOCKGATE_MAX_QUEUE": "lots"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "LOCKGATE_MAX_QUEUE must be an integer, got 'lots'" in result.stderr


def test_a_bad_flag_is_named(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--max-queue", "lots"])
    assert "--max-queue: must be an integer, got 'lots'" in capsys.readouterr().err
