"""The `lockgate` command: `serve` and `plugins`."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import signal
import sys

import pluggy
from aiohttp import web

from lockgate import __version__
from lockgate.server.config import Settings, serve_parser, settings_from_args
from lockgate.settings import InvalidSetting


def serve(settings: Settings, pm: pluggy.PluginManager | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (`pm`: the
    plugin manager, built as `create_app` builds it when None).

    In-flight requests get `settings.shutdown_grace` seconds to finish; a
    second signal while shutting down is ignored rather than cutting the
    clean-up short (systemd and container runtimes follow up with SIGKILL
    if they lose patience).
    """
    from lockgate.logging import configure_logging
    from lockgate.server.app import serving_process

    pm = serving_process(pm)
    configure_logging(settings.log_format, settings.log_level)
    # Should native code ever crash the process despite the limits on what
    # reaches it, the crash leaves every thread's Python stack on stderr
    # rather than nothing at all.
    faulthandler.enable()
    asyncio.run(_serve(settings, pm))


async def _serve(settings: Settings, pm: pluggy.PluginManager | None) -> None:
    from lockgate.server.app import create_app

    loop = asyncio.get_running_loop()
    runner = web.AppRunner(
        create_app(settings, pm=pm),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=settings.shutdown_grace,
    )
    await runner.setup()  # loads (and on first use compiles) the model
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        print(f"lockgate serving on http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        print("lockgate shutting down", file=sys.stderr, flush=True)
    finally:
        await runner.cleanup()


def list_plugins(as_json: bool) -> None:
    from lockgate.plugin_api.manager import describe_plugins, get_plugin_manager

    pm = get_plugin_manager()
    described = describe_plugins(pm)
    if as_json:
        print(json.dumps(described, indent=2))
        return
    for plugin in described:
        origin = f"  ({plugin['distribution']})" if plugin["distribution"] else ""
        print(f"{plugin['name']}{origin}")
        for hook in plugin["hooks"]:
            print(f"    {hook}")
    from lockgate.models.loading import registered_reasoning_formats, registered_tool_call_formats

    formats = registered_tool_call_formats(pm)
    print("tool-call formats (tried in this order): " + ", ".join(f.name for f in formats))
    reasoning = registered_reasoning_formats(pm)
    print("reasoning formats (tried in this order): " + ", ".join(f.name for f in reasoning))


def main(argv: list[str] | None = None) -> int:
    from lockgate.errors import ModelLoadError, PluginError

    try:
        # the plugins first: `serve`'s flags include those they add
        pm = None
        if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
            from lockgate.plugin_api.manager import get_plugin_manager

            pm = get_plugin_manager()
        parser = argparse.ArgumentParser(prog="lockgate", description="OpenAI-compatible LLM server")
        parser.add_argument("--version", action="version", version=f"lockgate {__version__}")
        commands = parser.add_subparsers(dest="command", required=True)
        serve_parser(commands.add_parser("serve", help="serve a model over the OpenAI API"), pm)
        plugins = commands.add_parser("plugins", help="list loaded plugins and their hooks")
        plugins.add_argument("--json", action="store_true", help="machine-readable output")
        args = parser.parse_args(argv)
        if args.command == "plugins":
            list_plugins(args.json)
        else:
            serve(settings_from_args(args, pm), pm)
    except (InvalidSetting, ModelLoadError, PluginError) as exc:
        # a mistake in how the server was set up: say it, no traceback
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
