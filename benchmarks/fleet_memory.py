"""A three-model session (chat, embed, rerank) in one `lockgate serve`, its
memory over time: the front and each model's process sampled from outside
(VmRSS) every `--interval` seconds while the session asks each model in
turn under a two-model limit, then goes idle until the TTL unloads them.

    python benchmarks/fleet_memory.py [--workdir DIR] [--chat FILE] [--embed FILE] [--rerank FILE]
        [--max-models 2] [--idle-ttl 20]

Without files it serves the default model as the chat model, and writes
random-weight Qwen3-0.6B-shaped files (Q8_0) for an embedder (last-token
pooling, as Qwen3-Embedding) and a reranker (a yes/no classification head,
as llama.cpp converts Qwen3-Reranker) into `--workdir`. Prints a line per
phase: each process's RSS in MiB, each model's state, and the total; then
the timeline (`--trace`: every sample).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import random
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import Launched, free_port  # noqa: E402
from memory import status_mib  # noqa: E402
from random_gguf import SHAPES, write_random_gguf  # noqa: E402

MODELS = ("chat", "embed", "rerank")


def model_files(args) -> dict[str, pathlib.Path]:
    from lockgate.plugins.models import locate_smollm2

    args.workdir.mkdir(parents=True, exist_ok=True)
    files = {"chat": args.chat or locate_smollm2(), "embed": args.embed, "rerank": args.rerank}
    shape = SHAPES["qwen3-0.6b"]
    for seed, (name, extra) in enumerate((("embed", {}), ("rerank", {"classifier_labels": ["yes", "no"]}))):
        if files[name] is None:
            path = args.workdir / f"random-qwen3-0.6b-{name}-Q8_0.gguf"
            if not path.exists():
                print(f"writing {path}", flush=True)
                write_random_gguf(path, dataclasses.replace(shape, config={**shape.config, **extra}), "Q8_0",
                                  seed=seed, backend="numpy")
            files[name] = path
    return {name: pathlib.Path(path) for name, path in files.items()}


def preset(files: dict[str, pathlib.Path], args) -> str:
    return "\n".join([
        f'[models.chat]\nmodel = "{files["chat"]}"\nmax_total_tokens = {args.total_tokens}\n',
        f'[models.embed]\nmodel = "{files["embed"]}"\npooling = "last"\nmax_total_tokens = {args.total_tokens}\n',
        f'[models.rerank]\nmodel = "{files["rerank"]}"\nmax_total_tokens = {args.total_tokens}\n',
    ])


class Timeline:
    """Samples of the front's and each loaded model's RSS, by the pids
    `/health` reports, and each model's state."""

    def __init__(self, url: str, front_pid: int, interval: float) -> None:
        self.url, self.front_pid, self.interval = url, front_pid, interval
        self.started = time.perf_counter()
        self.samples: list[dict] = []
        self.phase = "start"
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"{self.url}/health") as response:
                        models = (await response.json())["models"]
                except (aiohttp.ClientError, KeyError, ValueError):
                    models = {}
                sample = {"t": time.perf_counter() - self.started, "phase": self.phase,
                          "front": status_mib(self.front_pid, "VmRSS") or 0.0}
                for name, entry in models.items():
                    pid = entry.get("pid")
                    sample[name] = (entry["state"], status_mib(pid, "VmRSS") if pid else None)
                self.samples.append(sample)
                await asyncio.sleep(self.interval)

    def stop(self) -> None:
        self._task.cancel()


def total(sample: dict) -> float:
    return sample["front"] + sum((sample[m][1] or 0.0) for m in MODELS if m in sample)


def line(sample: dict) -> str:
    parts = [f"t {sample['t']:6.1f} s", f"{sample['phase']:<16}", f"front {sample['front']:6.0f}"]
    for name in MODELS:
        state, rss = sample.get(name, ("?", None))
        parts.append(f"{name} {state:<8} {'-' if rss is None else f'{rss:.0f}':>5}")
    parts.append(f"total {total(sample):6.0f}")
    return "  ".join(parts)


def sentence(rng: random.Random, words: int) -> str:
    vocabulary = "the a cat dog eats fish market fell today kitten milk mice lamp table river stone".split()
    return " ".join(rng.choice(vocabulary) for _ in range(words))


async def session_of(url: str, timeline: Timeline, args) -> None:
    rng = random.Random(0)
    v1 = f"{url}/v1"

    async def post(session, path: str, body: dict) -> dict:
        async with session.post(path, json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise SystemExit(f"error: {path} {response.status} {answer}")
            return answer

    async def chat(session) -> None:
        await asyncio.gather(*(post(session, f"{v1}/chat/completions", {
            "model": "chat", "messages": [{"role": "user", "content": sentence(rng, 20)}], "max_tokens": 64,
            "temperature": 0}) for _ in range(8)))

    async def embed(session) -> None:
        for _ in range(4):
            await post(session, f"{v1}/embeddings", {"model": "embed",
                                                     "input": [sentence(rng, 40) for _ in range(32)]})

    async def rerank(session) -> None:
        for _ in range(4):
            await post(session, f"{v1}/rerank", {"model": "rerank", "query": sentence(rng, 8),
                                                 "documents": [sentence(rng, 30) for _ in range(16)]})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for phase, work in (("chat", chat), ("embed", embed), ("rerank", rerank), ("chat again", chat),
                            ("embed again", embed)):
            timeline.phase = phase
            started = time.perf_counter()
            await work(session)
            print(f"{phase}: {time.perf_counter() - started:.1f} s", flush=True)
            await asyncio.sleep(2 * args.interval)
        timeline.phase = "idle"
        deadline = time.perf_counter() + args.idle_ttl + 30
        while time.perf_counter() < deadline:
            await asyncio.sleep(1)
            last = timeline.samples[-1] if timeline.samples else {}
            if all(last.get(m, ("",))[0] == "unloaded" for m in MODELS):
                break
        await asyncio.sleep(2 * args.interval)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/lockgate-fleet"))
    parser.add_argument("--chat", type=pathlib.Path)
    parser.add_argument("--embed", type=pathlib.Path)
    parser.add_argument("--rerank", type=pathlib.Path)
    parser.add_argument("--max-models", type=int, default=2)
    parser.add_argument("--idle-ttl", type=float, default=20.0)
    parser.add_argument("--total-tokens", type=int, default=4096)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--trace", action="store_true", help="print every sample, not only each phase's peak")
    args = parser.parse_args()
    files = model_files(args)
    preset_path = args.workdir / "models.toml"
    preset_path.write_text(preset(files, args))
    port = free_port()
    command = [sys.executable, "-m", "lockgate.server.cli", "serve", "--port", str(port),
               "--models-preset", str(preset_path), "--max-models", str(args.max_models),
               "--idle-ttl", str(args.idle_ttl), "--load-wait", "900"]
    print(" ".join(command), flush=True)
    for name, path in files.items():
        print(f"  {name}: {path} ({path.stat().st_size / (1 << 20):.0f} MiB)", flush=True)
    server = Launched("fleet", command, port)
    try:
        await server.wait_healthy(120)
        url = f"http://127.0.0.1:{port}"
        timeline = Timeline(url, server.process.pid, args.interval)
        await asyncio.sleep(2 * args.interval)
        try:
            await session_of(url, timeline, args)
        finally:
            timeline.stop()
    finally:
        server.stop()
    print("\neach phase's sample of the largest total (RSS, MiB):")
    phases = dict.fromkeys(s["phase"] for s in timeline.samples)
    for phase in phases:
        print(line(max((s for s in timeline.samples if s["phase"] == phase), key=total)))
    print("\nthe last sample:")
    print(line(timeline.samples[-1]))
    if args.trace:
        print("\ntimeline:")
        for sample in timeline.samples:
            print(line(sample))


if __name__ == "__main__":
    asyncio.run(main())
