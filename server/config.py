"""The `lockgate serve` flags, made from the one table in `lockgate.settings`
(which also makes the `Settings` object, re-exported here).

`app.py` and `cli.py` both import this module and it imports neither, so the
flags can be parsed by either launcher without a cycle.
"""

from __future__ import annotations

import argparse

from lockgate.settings import Settings, add_arguments, values_from_args

__all__ = ["Settings", "serve_parser", "settings_from_args"]


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The flags of `lockgate serve`. Unset flags fall back to `LOCKGATE_*`
    environment variables, then to the defaults."""
    parser = parser or argparse.ArgumentParser(prog="lockgate serve")
    add_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given in `args` over the environment over the defaults."""
    return Settings.from_env(**values_from_args(args))
