"""The `lockgate serve` flags, made from the settings table in
`lockgate.settings` (the server's settings and those its plugins add), which
also makes the `Settings` object, re-exported here.

`app.py` and `cli.py` both import this module and it imports neither, so the
flags can be parsed by either launcher without a cycle.
"""

from __future__ import annotations

import argparse

from lockgate.settings import Settings, add_arguments, settings_table, values_from_args

__all__ = ["Settings", "serve_parser", "settings_from_args"]


def serve_parser(parser: argparse.ArgumentParser | None = None, pm=None) -> argparse.ArgumentParser:
    """The flags of `lockgate serve`: the server's, and those the plugins of
    `pm` add (the built-in plugins' without one). Unset flags fall back to
    `LOCKGATE_*` environment variables, then to the defaults."""
    parser = parser or argparse.ArgumentParser(prog="lockgate serve")
    add_arguments(parser, settings_table(pm))
    return parser


def settings_from_args(args: argparse.Namespace, pm=None) -> Settings:
    """Flags given in `args` over the environment over the defaults."""
    table = settings_table(pm)
    return Settings.from_env(table=table, **values_from_args(args, table))
