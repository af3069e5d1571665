"""Load generator for OpenAI-compatible servers: throughput and latency under concurrency.

Streams chat or text completions (SSE) at one or more concurrency levels
against one or more base URLs and prints, per (server, concurrency), the
requests that succeeded and failed, aggregate output tokens per second, time
to first token, end-to-end latency and per-request decode speed; then the
ratios between servers when there are several. It can also start
`lockgate serve` and llama.cpp's `llama-server` itself, so one command
compares both on the same machine:

    python benchmarks/load.py --url http://127.0.0.1:8000/v1 --concurrency 1,4,16

    python benchmarks/load.py --launch-lockgate \\
        --launch-llama-server /path/to/llama-server --gguf /path/to/model.gguf \\
        --concurrency 1,4,16 --requests 8 --max-tokens 64 --ignore-eos

Only loopback URLs are accepted unless `--allow-remote` is given: this is a
load generator, and pointing it at someone else's server by mistake is rude.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import pathlib
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Any

import aiohttp
import numpy as np

# Upper bounds on what one run may ask for, so a typo cannot turn the
# benchmark into an accidental denial of service.
MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 1_024
MAX_PROMPT_TOKENS = 32_768

# Short, common English words: each is one token (plus its leading space) in
# the usual BPE vocabularies, so the word count approximates the token count.
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn cause much mean "
    "before move right boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross farm "
    "hard start might story saw far sea draw left late run while press close night real life few "
    "north open seem together next white children begin got walk example ease paper group always "
    "music those both mark often letter until mile river car feet care second book carry took "
    "science eat room friend began idea fish mountain stop once base hear horse cut sure watch color"
).split()


# ---------------------------------------------------------------- prompts


def make_prompts(count: int, approx_tokens: int, seed: int) -> list[str]:
    """`count` distinct prompts of about `approx_tokens` tokens each.

    Each prompt starts with its own index and words drawn afresh, so no two
    share a prefix beyond the chat template: a server's prefix cache cannot
    skip the prefill, which is part of what is being measured.
    """
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        words = [rng.choice(WORDS) for _ in range(max(approx_tokens - 12, 1))]
        prompts.append(
            f"Request {index}: " + " ".join(words) + ". Continue this text with a long story."
        )
    return prompts


# ---------------------------------------------------------------- one request


@dataclasses.dataclass
class RequestResult:
    """What one streamed request did; times are seconds from its start."""

    ok: bool
    error: str | None = None  # "429", "timeout", "connection", "stream", ...
    detail: str | None = None
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    token_source: str | None = None  # "usage" or "chunks"
    #: the prompt's tokens as the server counted them (its usage), or None
    prompt_tokens: int | None = None
    #: the generated text, all chunks together
    text: str = ""

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first over the time after the first, or None."""
        if not self.ok or self.tokens < 2 or self.ttft is None or self.latency is None:
            return None
        span = self.latency - self.ttft
        return (self.tokens - 1) / span if span > 0 else None


@dataclasses.dataclass
class Server:
    """A target: a label for the table, its base URL and the model to ask for."""

    label: str
    base_url: str
    model: str = ""


def request_body(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text one SSE chunk carries, chat or completions."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += delta.get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def stream_one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float
) -> RequestResult:
    """Send one streaming request and time it.

    Tokens come from the final `usage` chunk when the server sends one;
    otherwise every chunk that carries text counts as one token, which is
    what most servers send but undercounts when a chunk holds several.
    """
    started = time.perf_counter()
    first: float | None = None
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    content_chunks = 0
    texts: list[str] = []
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                text = await response.text()
                return RequestResult(ok=False, error=str(response.status), detail=text[:300])
            done = False
            # Whatever bytes have arrived are split into lines here, rather
            # than awaiting aiohttp's readline once per line: the client runs
            # on the server's cores, and its cost per token is in the figures.
            rest = b""
            async for received in response.content.iter_any():
                lines = (rest + received).split(b"\n")
                rest = lines.pop()
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return RequestResult(ok=False, error="stream", detail=json.dumps(chunk["error"])[:300])
                    text = chunk_text(chunk)
                    if text:
                        texts.append(text)
                        content_chunks += 1
                        if first is None:
                            first = time.perf_counter()
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            prompt_tokens = int(usage["prompt_tokens"])
                if done:
                    break
            if not done and rest.strip() == b"data: [DONE]":  # a last line with no newline after it
                done = True
            if not done:
                return RequestResult(ok=False, error="truncated", detail="stream ended without [DONE]")
    except TimeoutError:
        return RequestResult(ok=False, error="timeout", detail=f"no complete answer within {timeout}s")
    except aiohttp.ClientConnectionError as exc:
        return RequestResult(ok=False, error="connection", detail=str(exc)[:300])
    except (aiohttp.ClientError, ValueError) as exc:
        return RequestResult(ok=False, error="protocol", detail=f"{type(exc).__name__}: {exc}"[:300])
    ended = time.perf_counter()
    tokens, source = (usage_tokens, "usage") if usage_tokens is not None else (content_chunks, "chunks")
    return RequestResult(
        ok=True,
        ttft=None if first is None else first - started,
        latency=ended - started,
        tokens=tokens,
        token_source=source,
        prompt_tokens=prompt_tokens,
        text="".join(texts),
    )


# ---------------------------------------------------------------- one level


@dataclasses.dataclass
class LevelResult:
    """One (server, concurrency) cell of the table."""

    server: str
    concurrency: int
    wall: float
    results: list[RequestResult]
    skipped: int

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        errors: dict[str, int] = {}
        for r in self.results:
            if not r.ok:
                errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
        tokens = sum(r.tokens for r in ok)

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        ttfts = [r.ttft for r in ok if r.ttft is not None]
        latencies = [r.latency for r in ok if r.latency is not None]
        decode = [d for d in (r.decode_tps for r in ok) if d is not None]
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            "ok": len(ok),
            "errors": errors,
            "skipped": self.skipped,
            "wall_s": self.wall,
            "output_tokens": tokens,
            # equal work on both sides: the prompts as each server tokenized them
            "prompt_tokens": sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
            if any(r.prompt_tokens is not None for r in ok) else None,
            "token_sources": sorted({r.token_source for r in ok if r.token_source}),
            "output_tps": tokens / self.wall if self.wall > 0 else None,
            "ttft_p50": pct(ttfts, 50),
            "ttft_p90": pct(ttfts, 90),
            "ttft_p99": pct(ttfts, 99),
            "latency_p50": pct(latencies, 50),
            "latency_p90": pct(latencies, 90),
            "latency_p99": pct(latencies, 99),
            "decode_tps_p50": pct(decode, 50),
        }


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_level(
    server: Server, concurrency: int, prompts: list[str], args: argparse.Namespace
) -> LevelResult:
    """Send `len(prompts)` requests with `concurrency` of them in flight at a time.

    No new request starts once `--level-seconds` have passed, so a level that
    turns out slow is cut short (the rest are reported as skipped) rather
    than holding up the whole run.
    """
    url = server.base_url + ("/chat/completions" if args.endpoint == "chat" else "/completions")
    pending = list(enumerate(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)
    deadline = time.perf_counter() + args.level_seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        while pending and time.perf_counter() < deadline:
            index, prompt = pending.pop(0)
            body = request_body(args, server.model, prompt)
            results[index] = await stream_one(session, url, body, args.timeout)

    # A fresh connection per request: llama-server closes its end after each
    # streamed response, and reusing such a pooled connection fails with
    # "Can not write request body". On loopback a connect costs microseconds.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=connector, headers=headers(args.api_key)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    done = [r for r in results if r is not None]
    return LevelResult(server.label, concurrency, wall, done, skipped=len(prompts) - len(done))


# ---------------------------------------------------------------- targets


def check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"error: {url} is not a loopback address; pass --allow-remote if you mean it")


async def resolve_model(server: Server, args: argparse.Namespace) -> None:
    """Check the server answers and pick the model: `--model`, else its first listed id."""
    url = server.base_url + "/models"
    try:
        async with (
            aiohttp.ClientSession(headers=headers(args.api_key)) as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response,
        ):
            if response.status != 200:
                if args.model:
                    server.model = args.model
                    return
                text = (await response.text())[:200]
                raise SystemExit(f"error: GET {url} answered {response.status}: {text}")
            listing = await response.json()
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise SystemExit(
            f"error: cannot reach {server.label} at {server.base_url} "
            f"({type(exc).__name__}: {exc}); is the server running, and is the URL its /v1 base?"
        ) from None
    if args.model:
        server.model = args.model
        return
    ids = [m.get("id") for m in listing.get("data") or [] if m.get("id")]
    if not ids:
        raise SystemExit(f"error: {url} lists no models; pass --model")
    server.model = ids[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launched:
    """A server process this run started, its log in a temporary file."""

    def __init__(self, label: str, command: list[str], port: int) -> None:
        self.label = label
        self.port = port
        self.command = command
        self.log = tempfile.NamedTemporaryFile(prefix=f"load-{label}-", suffix=".log", delete=False)
        # A session of its own keeps the terminal's Ctrl-C away from it, so it
        # is stopped by `stop()` in order rather than killed mid-request.
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started = time.perf_counter()
        self.ready_after: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, lines: int = 20) -> str:
        text = pathlib.Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def wait_healthy(self, timeout: float) -> None:
        """Poll `/health` until 200; fail with the log's tail if it exits or times out."""
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.perf_counter() + timeout
        async with aiohttp.ClientSession() as session:
            while time.perf_counter() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(
                        f"error: {self.label} exited with {self.process.returncode} before it was healthy; "
                        f"log {self.log.name}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
                        if response.status == 200:
                            self.ready_after = time.perf_counter() - self.started
                            return
                await asyncio.sleep(0.5)
        raise SystemExit(
            f"error: {self.label} not healthy after {timeout:.0f}s; log {self.log.name}:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def launch_commands(args: argparse.Namespace, slots: int) -> list[tuple[str, list[str], int]]:
    """The servers `--launch-*` asks for, each given the same slot count and all cores."""
    commands = []
    cores = os.cpu_count() or 1
    if args.launch_lockgate:
        port = free_port()
        command = [sys.executable, "-m", "lockgate.server.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(port), "--max-num-seqs", str(slots)]
        if args.lockgate_model:
            command += ["--model", args.lockgate_model]
        command += shlex.split(args.lockgate_args)
        commands.append(("lockgate", command, port))
    if args.launch_llama_server:
        if not args.gguf:
            raise SystemExit("error: --launch-llama-server needs --gguf PATH")
        if not os.access(args.launch_llama_server, os.X_OK):
            raise SystemExit(f"error: {args.launch_llama_server} is not an executable file")
        if not os.path.isfile(args.gguf):
            raise SystemExit(f"error: no model file at {args.gguf}")
        port = free_port()
        # llama-server splits -c among its -np slots; each slot must hold the
        # chat template, the prompt (words can split into two tokens, hence
        # the 1.5) and the generated tokens. A multiple of 256 per slot keeps
        # llama.cpp from rounding the context it was given.
        per_slot = int(args.prompt_tokens * 1.5) + args.max_tokens + 128
        per_slot = -(-per_slot // 256) * 256
        ctx = args.llama_ctx or slots * per_slot
        command = [args.launch_llama_server, "-m", args.gguf, "-np", str(slots), "-c", str(ctx),
                   "--threads", str(cores), "--host", "127.0.0.1", "--port", str(port)]
        command += shlex.split(args.llama_args)
        commands.append(("llama-server", command, port))
    return commands


# ---------------------------------------------------------------- report


def fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


COLUMNS = (
    ("server", 16), ("conc", 4), ("ok", 4), ("errors", 10), ("prompt tok", 10), ("out tok", 7), ("out tok/s", 9),
    ("ttft p50", 8), ("p90", 7), ("p99", 7), ("e2e p50", 7), ("p90", 7), ("p99", 7), ("dec tok/s", 9),
)


def table_header() -> str:
    head = " ".join(f"{name:>{width}}" if i else f"{name:<{width}}" for i, (name, width) in enumerate(COLUMNS))
    note = ("(prompt tok and out tok: totals as each server counted them; ttft in ms, e2e in s; "
            "dec tok/s is the per-request p50)")
    return f"{head}\n{note}"


def table_row(s: dict[str, Any]) -> str:
    errors = ",".join(f"{k}:{v}" for k, v in sorted(s["errors"].items())) or "0"
    if s["skipped"]:
        errors += f",skip:{s['skipped']}"
    # A trailing `~` says some tokens were counted from chunks, not from usage.
    approx = "~" if "chunks" in s["token_sources"] else ""
    cells = (
        s["server"], s["concurrency"], s["ok"], errors, fmt(s["prompt_tokens"]), s["output_tokens"],
        fmt(s["output_tps"], digits=1) + approx,
        fmt(s["ttft_p50"], 1000), fmt(s["ttft_p90"], 1000), fmt(s["ttft_p99"], 1000),
        fmt(s["latency_p50"], digits=2), fmt(s["latency_p90"], digits=2), fmt(s["latency_p99"], digits=2),
        fmt(s["decode_tps_p50"], digits=1),
    )
    return " ".join(
        f"{c!s:>{w}}" if i else f"{c!s:<{w}}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))
    )


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def ratio_lines(summaries: list[dict[str, Any]], servers: list[Server]) -> list[str]:
    """Each other server against the first, level by level.

    Above 1 means higher: better for throughput columns, worse for latency.
    """
    base = servers[0].label
    lines = [f"ratios against {base} (throughput: higher is better; latency: lower is better)"]
    by_key = {(s["server"], s["concurrency"]): s for s in summaries}
    for server in servers[1:]:
        for (label, conc), s in by_key.items():
            if label != server.label or (base, conc) not in by_key:
                continue
            b = by_key[(base, conc)]
            lines.append(
                f"  {server.label}/{base} conc {conc:>3}: out tok/s {ratio(s['output_tps'], b['output_tps'])}"
                f"  ttft p50 {ratio(s['ttft_p50'], b['ttft_p50'])}"
                f"  e2e p50 {ratio(s['latency_p50'], b['latency_p50'])}"
                f"  dec tok/s {ratio(s['decode_tps_p50'], b['decode_tps_p50'])}"
            )
    return lines


# ---------------------------------------------------------------- main


def parse_levels(values: list[str]) -> list[int]:
    levels: list[int] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            level = int(part)
            if not 1 <= level <= MAX_CONCURRENCY:
                raise SystemExit(f"error: concurrency {level} outside 1..{MAX_CONCURRENCY}")
            if level not in levels:
                levels.append(level)
    return levels or [1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_argument_group("targets")
    target.add_argument("--url", action="append", default=[],
                        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (repeatable)")
    target.add_argument("--model", help="model for every request (default: each server's first /v1/models id)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default $OPENAI_API_KEY)")
    target.add_argument("--allow-remote", action="store_true", help="accept non-loopback URLs")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", action="append", default=[],
                      help="requests in flight; repeatable or a comma list, e.g. 1,4,16 (default 1)")
    load.add_argument("--requests", type=int, default=16, help="requests per concurrency level (default 16)")
    load.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    load.add_argument("--ignore-eos", action="store_true",
                      help='send "ignore_eos": true so each request generates exactly --max-tokens')
    load.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length (default 128)")
    load.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    load.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature sent with every request (default 0: greedy, repeatable)")
    load.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    load.add_argument("--level-seconds", type=float, default=600.0,
                      help="no new request starts after this long in one level (default 600)")
    load.add_argument("--warmup", type=int, default=2,
                      help="unmeasured requests per server before the first level (default 2)")
    load.add_argument("--seed", type=int, default=0, help="seed for the prompts (default 0)")
    load.add_argument("--json", type=pathlib.Path, help="write every request's raw result here")
    launch = parser.add_argument_group("launching servers (each on a free loopback port, stopped at the end)")
    launch.add_argument("--launch-lockgate", action="store_true", help="start `lockgate serve` and benchmark it")
    launch.add_argument("--lockgate-model", help="--model for the launched lockgate (default: its default)")
    launch.add_argument("--lockgate-args", default="", help="extra arguments for lockgate serve, one string")
    launch.add_argument("--launch-llama-server", metavar="BINARY", help="start llama.cpp's llama-server")
    launch.add_argument("--gguf", metavar="PATH", help="model file for --launch-llama-server")
    launch.add_argument("--llama-ctx", type=int, help="-c for llama-server (default: enough for every slot)")
    launch.add_argument("--llama-args", default="", help="extra arguments for llama-server, one string")
    launch.add_argument("--launch-timeout", type=float, default=900.0,
                        help="seconds a launched server may take to become healthy (default 900)")
    args = parser.parse_args(argv)
    args.levels = parse_levels(args.concurrency)
    if not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--requests must be within 1..{MAX_REQUESTS}")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be positive")
    if not 1 <= args.prompt_tokens <= MAX_PROMPT_TOKENS:
        parser.error(f"--prompt-tokens must be within 1..{MAX_PROMPT_TOKENS}")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    if not args.url and not args.launch_lockgate and not args.launch_llama_server:
        parser.error("give at least one --url, --launch-lockgate or --launch-llama-server")
    return args


async def benchmark(args: argparse.Namespace) -> int:
    for url in args.url:
        if not args.allow_remote:
            check_loopback(url)
    servers = [Server(label=urllib.parse.urlsplit(u).netloc or u, base_url=u.rstrip("/")) for u in args.url]
    launched: list[Launched] = []
    try:
        for label, command, port in launch_commands(args, max(args.levels)):
            print(f"starting {label}: {shlex.join(command)}", flush=True)
            launched.append(Launched(label, command, port))
        # Started together, waited for together: lockgate's first start may
        # compile for minutes, and llama-server can load meanwhile.
        await asyncio.gather(*(p.wait_healthy(args.launch_timeout) for p in launched))
        for p in launched:
            print(f"{p.label} healthy after {p.ready_after:.1f}s on {p.base_url} (log {p.log.name})", flush=True)
            servers.append(Server(label=p.label, base_url=p.base_url))
        for server in servers:
            await resolve_model(server, args)
            print(f"{server.label}: {server.base_url}, model {server.model!r}", flush=True)

        prompts = make_prompts(args.requests * len(args.levels) + args.warmup, args.prompt_tokens, args.seed)
        for server in servers:
            if args.warmup:
                warm = await run_level(server, 1, prompts[: args.warmup], args)
                bad = [r for r in warm.results if not r.ok]
                if bad:
                    print(f"warning: {server.label} warm-up: {len(bad)} failed, first: {bad[0].error} "
                          f"{bad[0].detail}", file=sys.stderr)

        print(f"\n{args.endpoint}, {args.requests} requests per level, ~{args.prompt_tokens} prompt tokens, "
              f"max_tokens {args.max_tokens}{', ignore_eos' if args.ignore_eos else ''}\n")
        print(table_header(), flush=True)
        levels: list[LevelResult] = []
        for n, concurrency in enumerate(args.levels):
            # Every server gets the same prompts at a level, and the order the
            # servers go in rotates from level to level, so none always runs
            # first (cold) or last (after the machine has warmed up).
            start = args.warmup + n * args.requests
            level_prompts = prompts[start : start + args.requests]
            shift = n % len(servers)
            for server in servers[shift:] + servers[:shift]:
                level = await run_level(server, concurrency, level_prompts, args)
                levels.append(level)
                print(table_row(level.summary()), flush=True)
                failed = [r for r in level.results if not r.ok]
                if failed:
                    print(f"  first error: {failed[0].error} {failed[0].detail}", flush=True)

        summaries = sorted((lv.summary() for lv in levels), key=lambda s: (s["concurrency"],))
        if len(servers) > 1:
            print()
            print("\n".join(ratio_lines(summaries, servers)))
        if args.json:
            payload = {
                "config": {k: v for k, v in vars(args).items() if k not in {"json", "api_key"}},
                "servers": [dataclasses.asdict(s) for s in servers],
                "launched": [{"label": p.label, "command": p.command, "ready_after_s": p.ready_after}
                             for p in launched],
                "summaries": summaries,
                "levels": [{"server": lv.server, "concurrency": lv.concurrency, "wall_s": lv.wall,
                            "skipped": lv.skipped, "requests": [dataclasses.asdict(r) for r in lv.results]}
                           for lv in levels],
            }
            args.json.write_text(json.dumps(payload, indent=2, default=str))
            print(f"\nraw results written to {args.json}")
        failures = sum(1 for lv in levels for r in lv.results if not r.ok)
        return 1 if failures else 0
    finally:
        for p in launched:
            p.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(benchmark(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
