"""The `lockgate` command: `serve` and `plugins`."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import signal
import sys
from pathlib import Path

from aiohttp import web

from lockgate import __version__
from lockgate.server.config import Settings


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The flags of `lockgate serve`. Unset flags fall back to `LOCKGATE_*`
    environment variables, then to the defaults."""
    parser = parser or argparse.ArgumentParser(prog="lockgate serve")
    d = Settings()
    parser.add_argument("--model", help=f"registered model name or GGUF path (default {d.model})")
    parser.add_argument("--served-model-name", help="name clients use (default: the model's)")
    parser.add_argument("--host", help=f"address to listen on (default {d.host})")
    parser.add_argument("--port", type=int, help=f"port (default {d.port})")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template file overriding the model's")
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        help="required bearer key(s), comma separated (env LOCKGATE_API_KEY)",
    )
    parser.add_argument(
        "--allowed-origins",
        help="browser origins allowed to call the API (CORS), comma separated, or '*' (default none)",
    )
    parser.add_argument(
        "--metrics-public", action="store_const", const=True,
        help="serve /metrics without the API key (default: it needs the key when keys are set)",
    )
    parser.add_argument("--max-body-size", type=int, help=f"bytes (default {d.max_body_size})")
    parser.add_argument("--executor", help=f"executor plugin (default {d.executor})")
    parser.add_argument("--target", choices=["auto", "llvm", "cuda"], help="compile target (default auto)")
    parser.add_argument("--max-num-seqs", type=int, help=f"sequences per decode batch (default {d.max_num_seqs})")
    parser.add_argument(
        "--max-total-tokens", type=int, help=f"KV cache capacity in tokens (default {d.max_total_tokens})"
    )
    parser.add_argument(
        "--prefill-chunk-size", type=int, help=f"tokens per prefill call (default {d.prefill_chunk_size})"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int,
        help="tokens per engine step, decode plus prefill chunks (default: --prefill-chunk-size)",
    )
    parser.add_argument("--max-queue", type=int, help=f"waiting requests before 429 (default {d.max_queue})")
    parser.add_argument("--max-n", type=int, help=f"largest n a request may ask (default {d.max_n})")
    parser.add_argument("--num-threads", type=int, help="CPU threads for the executor")
    parser.add_argument("--cache-dir", type=Path, help="compiled-model cache (default ~/.cache/lockgate)")
    parser.add_argument("--shutdown-grace", type=float, help="seconds in-flight requests get on shutdown")
    parser.add_argument("--log-format", choices=["auto", "console", "json"])
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k in Settings.__dataclass_fields__}
    return Settings.from_env(**overrides)


def serve(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully.

    In-flight requests get `settings.shutdown_grace` seconds to finish; a
    second signal while shutting down is ignored rather than cutting the
    clean-up short (systemd and container runtimes follow up with SIGKILL
    if they lose patience).
    """
    from lockgate.logging import configure_logging

    configure_logging(settings.log_format, settings.log_level)
    # Should native code ever crash the process despite the limits on what
    # reaches it, the crash leaves every thread's Python stack on stderr
    # rather than nothing at all.
    faulthandler.enable()
    asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> None:
    from lockgate.server.app import create_app

    loop = asyncio.get_running_loop()
    runner = web.AppRunner(
        create_app(settings),
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

    described = describe_plugins(get_plugin_manager())
    if as_json:
        print(json.dumps(described, indent=2))
        return
    for plugin in described:
        origin = f"  ({plugin['distribution']})" if plugin["distribution"] else ""
        print(f"{plugin['name']}{origin}")
        for hook in plugin["hooks"]:
            print(f"    {hook}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lockgate", description="OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"lockgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser(commands.add_parser("serve", help="serve a model over the OpenAI API"))
    plugins = commands.add_parser("plugins", help="list loaded plugins and their hooks")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "plugins":
        list_plugins(args.json)
        return 0
    from lockgate.errors import ModelLoadError

    try:
        serve(settings_from_args(args))
    except ModelLoadError as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
