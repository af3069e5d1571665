"""Server memory, side by side: `lockgate serve` and llama-server on the same
GGUF file at equal KV capacity, each sampled from outside as its own process.

For each server: its resident memory (VmRSS) every `--interval` seconds from
launch until it is healthy ("load": the peak of those samples and the
kernel's high-water mark, VmHWM), once healthy ("ready"), then with every
one of `--seqs` sequences filled at once to its share of the `--total-tokens`
cache (completions of random token-id prompts, `ignore_eos`, all in flight
together) and after they finished ("KV full"), and the high-water mark over
the whole run ("peak"). llama-server gets a unified KV cache of the same
size (`-c TOTAL -np SEQS --kv-unified`). lockgate's compile cache should be
warm (run once first): a compile's own memory is not what a load costs.

    python benchmarks/memory.py --gguf FILE [--launch-llama-server BINARY]
        [--total-tokens 8192] [--seqs 16] [--trace] [--json]

`--trace` prints each server's RSS over time (a line per half second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import shlex
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import Launched, free_port  # noqa: E402 (beside this script, not a package)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def status_mib(pid: int, field: str) -> float | None:
    """A `/proc/PID/status` figure (VmRSS, VmHWM) in MiB; None once gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Sampler:
    """RSS samples of one process, taken on the event loop every `interval`."""

    def __init__(self, pid: int, interval: float) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self.started = time.perf_counter()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            rss = status_mib(self.pid, "VmRSS")
            if rss is None:
                return
            self.samples.append((time.perf_counter() - self.started, rss))
            await asyncio.sleep(self.interval)

    def peak_since(self, t0: float) -> float:
        return max((rss for t, rss in self.samples if t >= t0), default=0.0)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def stop(self) -> None:
        self._task.cancel()


def vocab_size(path: str) -> int:
    from lockgate.models.config import ModelConfig
    from lockgate.models.gguf_metadata import GGUFMetadata

    return ModelConfig.from_gguf(GGUFMetadata(path)).vocab_size


async def fill(url: str, model: str, seqs: int, total_tokens: int, vocab: int, seed: int) -> int:
    """Every sequence at once, each to its share of the cache less a margin
    for what a server keeps apart (llama-server reserves a token or two);
    returns the tokens generated."""
    share = total_tokens // seqs
    rng = random.Random(seed)
    out_tokens = 8
    prompt_tokens = share - out_tokens - 16

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_tokens)]
        body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
        async with session.post(f"{url}/completions", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise SystemExit(f"error: {response.status} {json.dumps(answer)[:300]}")
            return answer["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        return sum(await asyncio.gather(*(one(session, i) for i in range(seqs))))


async def measure(label: str, command: list[str], port: int, args) -> dict:
    print(f"starting {label}: {shlex.join(command)}", flush=True)
    server = Launched(label, command, port)
    sampler = Sampler(server.process.pid, args.interval)
    try:
        await server.wait_healthy(args.launch_timeout)
        ready_at = sampler.now()
        figures = {"load s": round(ready_at, 1), "load peak MiB": sampler.peak_since(0.0),
                   "load HWM MiB": status_mib(server.process.pid, "VmHWM") or 0.0}
        await asyncio.sleep(1.0)
        figures["ready MiB"] = status_mib(server.process.pid, "VmRSS") or 0.0
        model = "default"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.base_url}/models") as response:
                listed = await response.json()
                model = listed["data"][0]["id"] if listed.get("data") else model
        fill_from = sampler.now()
        generated = await fill(server.base_url, model, args.seqs, args.total_tokens, args.vocab, args.seed)
        figures["filling peak MiB"] = sampler.peak_since(fill_from)
        await asyncio.sleep(2.0)
        figures["KV full MiB"] = status_mib(server.process.pid, "VmRSS") or 0.0
        figures["peak MiB"] = status_mib(server.process.pid, "VmHWM") or 0.0
        figures["generated"] = generated
        figures["trace"] = [(round(t, 2), round(rss, 1)) for t, rss in sampler.samples]
        print("  " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in figures.items() if k != "trace"), flush=True)
        return figures
    finally:
        sampler.stop()
        server.stop()


def commands(args) -> list[tuple[str, list[str], int]]:
    cores = str(args.threads or os.cpu_count() or 1)
    port = free_port()
    out = [("lockgate", [sys.executable, "-m", "lockgate.server.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(port), "--model", args.gguf, "--max-total-tokens", str(args.total_tokens),
                         "--max-num-seqs", str(args.seqs), "--num-threads", cores,
                         *shlex.split(args.lockgate_args)], port)]
    if args.launch_llama_server:
        port = free_port()
        out.append(("llama-server", [args.launch_llama_server, "-m", args.gguf, "-c", str(args.total_tokens),
                                     "-np", str(args.seqs), "--kv-unified", "--threads", cores,
                                     "--host", "127.0.0.1", "--port", str(port),
                                     *shlex.split(args.llama_args)], port))
    return out


ROWS = ("load s", "load peak MiB", "load HWM MiB", "ready MiB", "filling peak MiB", "KV full MiB", "peak MiB")


def report(results: dict[str, dict], args) -> None:
    names = list(results)
    print(f"\n{pathlib.Path(args.gguf).name}: KV {args.total_tokens} tokens shared by {args.seqs} sequences, "
          f"filled at once; {args.threads or os.cpu_count()} threads")
    header = "| figure | " + " | ".join(names) + (" | lockgate / llama-server |" if len(names) == 2 else " |")
    print(header)
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for row in ROWS:
        values = [results[name][row] for name in names]
        cells = [f"{v:,.1f}" if row == "load s" else f"{v:,.0f}" for v in values]
        ratio = f" | {values[0] / values[1]:.2f}" if len(values) == 2 and values[1] else ""
        print(f"| {row} | " + " | ".join(cells) + ratio + " |")
    for name in names:
        settled = results[name]["KV full MiB"]
        load_peak = max(results[name]["load peak MiB"], results[name]["load HWM MiB"])
        print(f"{name}: load peak {load_peak:,.0f} MiB is {100 * (load_peak / settled - 1):+.1f} % "
              f"of its settled RSS with the KV full ({settled:,.0f} MiB)")
    if args.trace:
        for name in names:
            print(f"\n{name}, RSS over time (s, MiB):")
            last = -1.0
            for t, rss in results[name]["trace"]:
                if t - last >= 0.5:
                    print(f"  {t:7.2f} {rss:8.1f}")
                    last = t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the GGUF file both servers load")
    parser.add_argument("--launch-llama-server", metavar="BINARY", help="llama-server to compare with")
    parser.add_argument("--total-tokens", type=int, default=8192, help="KV cache tokens, shared by all sequences")
    parser.add_argument("--seqs", type=int, default=16, help="sequences filled at once")
    parser.add_argument("--threads", type=int, help="threads per server (default: every core)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between RSS samples")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lockgate-args", default="", help="more flags for lockgate serve")
    parser.add_argument("--llama-args", default="", help="more flags for llama-server")
    parser.add_argument("--trace", action="store_true", help="print RSS over time")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    args.vocab = vocab_size(args.gguf)

    async def run() -> dict[str, dict]:
        return {label: await measure(label, command, port, args) for label, command, port in commands(args)}

    results = asyncio.run(run())
    report(results, args)
    if args.json:
        print(json.dumps({name: {k: v for k, v in figures.items() if k != "trace"}
                          for name, figures in results.items()}, indent=1))


if __name__ == "__main__":
    main()
