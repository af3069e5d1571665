"""Server settings: the `Settings` object and the `lockgate serve` flags, both
made from the one table in `lockgate.settings`.

`app.py` and `cli.py` both import this module and it imports neither, so the
flags can be parsed by either launcher without a cycle.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from lockgate.engine import EngineOptions
from lockgate.models.executor import ExecutorOptions
from lockgate.settings import SETTINGS, InvalidSetting, add_arguments, get_setting, values_from_args, values_from_env


def _fields_from_table(cls: type) -> type:
    """Make `cls` a dataclass with one field per entry of `SETTINGS`, the
    entry's default as the field's."""
    cls.__annotations__ = {setting.name: setting.annotation for setting in SETTINGS}
    for setting in SETTINGS:
        setattr(cls, setting.name, setting.default)
    return dataclasses.dataclass(cls)


@_fields_from_table
class Settings:
    """Everything `lockgate serve` can be told: one field per entry of
    `lockgate.settings.SETTINGS` (`Settings().port`, `Settings(port=9000)`)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then `LOCKGATE_*` variables, then `overrides` (those not
        None; text is parsed like a variable's, so `api_keys="a,b"` works).
        Raises `InvalidSetting` naming the variable or setting that does not parse."""
        env = os.environ if env is None else env
        values = values_from_env(env)
        for name, value in overrides.items():
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = get_setting(name).parse(value)
                except InvalidSetting as exc:
                    raise InvalidSetting(f"{name} {exc}") from None
            values[name] = value
        return cls(**values)

    def executor_options(self, progress=None) -> ExecutorOptions:
        return ExecutorOptions(**self._held_by(ExecutorOptions), progress=progress)

    def engine_options(self) -> EngineOptions:
        return EngineOptions(**self._held_by(EngineOptions))

    def _held_by(self, options_class: type) -> dict[str, Any]:
        """The settings `options_class` has a field of the same name for."""
        names = {field.name for field in dataclasses.fields(options_class)}
        return {setting.name: getattr(self, setting.name) for setting in SETTINGS if setting.name in names}


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The flags of `lockgate serve`. Unset flags fall back to `LOCKGATE_*`
    environment variables, then to the defaults."""
    parser = parser or argparse.ArgumentParser(prog="lockgate serve")
    add_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given in `args` over the environment over the defaults."""
    return Settings.from_env(**values_from_args(args))
