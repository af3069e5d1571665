"""Prefix caching under two kinds of traffic that repeat themselves, for
lockgate with its prefix cache, lockgate without it, and llama.cpp's
`llama-server` (its default per-slot prompt cache), one server at a time on
the same machine and model:

* shared system prompt: `--requests` chat requests (32) with the same long
  system prompt (~1,000 tokens) and each its own short question, at
  `--concurrency` (4);
* multi-turn chat: `--conversations` (8) conversations of `--turns` (4)
  turns, every turn resending the whole history (a shared system prompt,
  the user's messages and the answers so far), the conversations
  `--concurrency` at a time.

Every answer is `--max-tokens` (32) tokens, greedy, with `ignore_eos`, so
each server does the same decoding work. Printed per server and scenario:
TTFT percentiles, total wall time, and the prompt tokens the server says it
took from its cache; then the ratios the targets are stated in.

    python benchmarks/prefix.py --launch-llama-server /path/to/llama-server \\
        --gguf "$(python -c 'from lockgate.plugins.models import locate_smollm2; print(locate_smollm2())')"
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import shlex
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from load import WORDS, Launched, free_port  # noqa: E402


@dataclasses.dataclass
class Turn:
    ttft: float
    latency: float
    text: str
    prompt_tokens: int
    cached_tokens: int


async def chat(session: aiohttp.ClientSession, base_url: str, model: str, messages, max_tokens: int) -> Turn:
    """One streamed greedy chat completion, timed."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    text, usage = "", {}
    async with session.post(base_url + "/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"in-stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
            usage = chunk.get("usage") or usage
    ended = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:  # llama-server's own account, where it gives no details
        cached = (chunk.get("timings") or {}).get("cache_n", 0)
    return Turn(
        ttft=(first or ended) - started, latency=ended - started, text=text,
        prompt_tokens=int(usage.get("prompt_tokens") or 0), cached_tokens=int(cached or 0),
    )


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def shared_system_prompt(base_url: str, model: str, args) -> list[Turn]:
    rng = random.Random(args.seed)
    system = "You are a helpful assistant. Background notes: " + words(rng, args.system_words) + "."
    questions = [f"Question {i}: what about the {words(rng, 6)}?" for i in range(args.requests)]
    pending = list(questions)
    turns: list[Turn] = []

    async def worker(session):
        while pending:
            question = pending.pop(0)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            turns.append(await chat(session, base_url, model, messages, args.max_tokens))

    async with _session(args.concurrency) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    return turns


async def multi_turn(base_url: str, model: str, args) -> list[Turn]:
    rng = random.Random(args.seed + 1)
    system = "You are a helpful assistant. House rules: " + words(rng, args.system_words // 2) + "."
    openers = [words(rng, args.user_words) for _ in range(args.conversations * args.turns)]
    pending = list(range(args.conversations))
    turns: list[Turn] = []

    async def conversation(session, index):
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Turn {turn}: {openers[index * args.turns + turn]}"})
            answer = await chat(session, base_url, model, messages, args.max_tokens)
            turns.append(answer)
            messages.append({"role": "assistant", "content": answer.text})

    async def worker(session):
        while pending:
            await conversation(session, pending.pop(0))

    async with _session(args.concurrency) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    return turns


def _session(concurrency: int) -> aiohttp.ClientSession:
    # a fresh connection per request: llama-server closes its end after a stream
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800))


def summary(turns: list[Turn], wall: float) -> dict:
    ttfts = [t.ttft for t in turns]
    return {
        "requests": len(turns),
        "ttft_p50": float(np.percentile(ttfts, 50)),
        "ttft_p90": float(np.percentile(ttfts, 90)),
        "total_s": wall,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
    }


def servers(args) -> list[tuple[str, list[str], int]]:
    cores = str(os.cpu_count() or 1)
    commands = []
    for label, extra in (("lockgate (cache)", []), ("lockgate (no cache)", ["--no-prefix-cache"])):
        port = free_port()
        commands.append((label, [sys.executable, "-m", "lockgate.server.cli", "serve", "--port", str(port),
                                 "--max-num-seqs", str(args.concurrency), *extra,
                                 *shlex.split(args.lockgate_args)], port))
    if args.launch_llama_server:
        port = free_port()
        commands.append(("llama-server", [args.launch_llama_server, "-m", args.gguf, "-np", str(args.concurrency),
                                          "-c", str(args.concurrency * args.llama_slot_ctx), "--threads", cores,
                                          "--host", "127.0.0.1", "--port", str(port)], port))
    return commands


async def benchmark(args) -> int:
    results: dict[str, dict[str, dict]] = {}
    for label, command, port in servers(args):
        server = Launched(label.split()[0], command, port)
        print(f"starting {label}: {shlex.join(command)}", flush=True)
        try:
            await server.wait_healthy(args.launch_timeout)
            model = "smollm2" if label.startswith("lockgate") else "default"
            # warm-up: first-request costs (grammar tables, allocator) out of the figures
            async with _session(1) as session:
                await chat(session, server.base_url, model, [{"role": "user", "content": "Hello"}], 4)
            results[label] = {}
            for name, scenario in (("shared system prompt", shared_system_prompt), ("multi-turn chat", multi_turn)):
                started = time.perf_counter()
                turns = await scenario(server.base_url, model, args)
                results[label][name] = summary(turns, time.perf_counter() - started)
                s = results[label][name]
                print(f"  {name}: TTFT p50 {s['ttft_p50'] * 1000:.0f} ms, p90 {s['ttft_p90'] * 1000:.0f} ms, "
                      f"total {s['total_s']:.1f} s, cached {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens",
                      flush=True)
        finally:
            server.stop()

    print(f"\n{args.requests} requests / {args.conversations}x{args.turns} turns, concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens out, load average {os.getloadavg()[0]:.1f}\n")
    print("| scenario | server | TTFT p50 | TTFT p90 | total | prompt tokens from cache |")
    print("|---|---|---|---|---|---|")
    for name in ("shared system prompt", "multi-turn chat"):
        for label, by_scenario in results.items():
            s = by_scenario[name]
            print(f"| {name} | {label} | {s['ttft_p50'] * 1000:.0f} ms | {s['ttft_p90'] * 1000:.0f} ms | "
                  f"{s['total_s']:.1f} s | {s['cached_tokens']} of {s['prompt_tokens']} |")
    cache, bare = results.get("lockgate (cache)"), results.get("lockgate (no cache)")
    if cache and bare:
        shared, turns = "shared system prompt", "multi-turn chat"
        print(f"\nshared system prompt, TTFT p50 with/without the cache: "
              f"{cache[shared]['ttft_p50'] / bare[shared]['ttft_p50']:.2f} (target <= 0.25)")
        print(f"multi-turn chat, total time with/without the cache: "
              f"{cache[turns]['total_s'] / bare[turns]['total_s']:.2f} (target <= 0.5)")
        if "llama-server" in results:
            print(f"multi-turn chat, total time lockgate (cache) / llama-server: "
                  f"{cache[turns]['total_s'] / results['llama-server'][turns]['total_s']:.2f} (target < 1)")
    if args.json:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=900, help="words of the shared system prompt (~1 token each)")
    parser.add_argument("--user-words", type=int, default=60, help="words of each user message")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lockgate-args", default="", help="extra `lockgate serve` arguments, one string")
    parser.add_argument("--launch-llama-server", metavar="BINARY")
    parser.add_argument("--gguf", metavar="PATH", help="the model file for llama-server")
    parser.add_argument("--llama-slot-ctx", type=int, default=4096, help="context per llama-server slot")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.launch_llama_server and not args.gguf:
        parser.error("--launch-llama-server needs --gguf")
    return asyncio.run(benchmark(args))


if __name__ == "__main__":
    sys.exit(main())
