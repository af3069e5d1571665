"""Embeddings, side by side: `lockgate serve` and llama-server (`--embedding
--pooling P`) on the same GGUF file, both asked over `/v1/embeddings` for
the same inputs.

For each server: the vectors' agreement (cosine of lockgate's to
llama-server's, lowest over the inputs), then three timed workloads, run
one after the other with nothing else on the machine:

* `single`: one short input per request, requests one at a time (ms each);
* `batch`: requests of `--batch` short inputs (inputs per second);
* `long`: requests of 4 inputs of about `--long-tokens` tokens each (prompt
  tokens per second).

    python benchmarks/embeddings.py --gguf FILE --launch-llama-server BINARY
        [--pooling mean] [--batch 64] [--repeats 3] [--json]

Medians of `--repeats` runs; lockgate's compile cache should be warm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import Launched, free_port  # noqa: E402 (beside this script, not a package)

WORDS = ("the cat sat on a mat while the dog ran after red balls in green parks near old stone houses by "
         "the river where children play and birds sing songs of spring").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


#: the model each server serves, by its base URL (from `/v1/models`)
MODELS: dict[str, str] = {}


async def embed(session: aiohttp.ClientSession, url: str, inputs: list[str]) -> tuple[list[np.ndarray], int]:
    if url not in MODELS:
        async with session.get(f"{url}/models") as response:
            MODELS[url] = (await response.json())["data"][0]["id"]
    async with session.post(f"{url}/embeddings", json={"model": MODELS[url], "input": inputs,
                                                       "encoding_format": "float"}) as response:
        body = await response.json()
        if response.status != 200:
            raise SystemExit(f"error: {url} answered {response.status}: {body}")
    return [np.asarray(d["embedding"], dtype=np.float64) for d in body["data"]], body["usage"]["prompt_tokens"]


async def timed(session, url: str, requests: list[list[str]]) -> tuple[float, int, int]:
    """Seconds for the requests one after the other, inputs and tokens."""
    started = time.perf_counter()
    inputs = tokens = 0
    for one in requests:
        vectors, used = await embed(session, url, one)
        inputs += len(vectors)
        tokens += used
    return time.perf_counter() - started, inputs, tokens


async def measure(url: str, workloads: dict, repeats: int) -> dict:
    figures = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await embed(session, url, ["warm up"])
        for name, requests in workloads.items():
            runs = [await timed(session, url, requests) for _ in range(repeats)]
            seconds = statistics.median(r[0] for r in runs)
            _, inputs, tokens = runs[0]
            figures[name] = {"seconds": seconds, "inputs": inputs, "tokens": tokens,
                             "ms_per_request": 1000 * seconds / len(requests),
                             "inputs_per_s": inputs / seconds, "tokens_per_s": tokens / seconds}
    return figures


async def vectors_of(url: str, inputs: list[str]) -> list[np.ndarray]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return (await embed(session, url, inputs))[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--launch-llama-server", metavar="BINARY", required=True)
    parser.add_argument("--pooling", default="mean", choices=("mean", "last", "cls"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    workloads = {
        "single": [[sentence(rng, 12)] for _ in range(32)],
        "batch": [[sentence(rng, 12) for _ in range(args.batch)] for _ in range(4)],
        "long": [[sentence(rng, int(args.long_tokens * 0.8)) for _ in range(4)] for _ in range(2)],
    }
    probe = [sentence(rng, n) for n in (1, 5, 12, 40, 200)] + ["Paris is the capital of France."]
    cores = str(os.cpu_count() or 1)
    lockgate_port, llama_port = free_port(), free_port()
    servers = {
        "lockgate": Launched("lockgate", [sys.executable, "-m", "lockgate.server.cli", "serve", "--host", "127.0.0.1",
                                          "--port", str(lockgate_port), "--model", args.gguf,
                                          "--pooling", args.pooling], lockgate_port),
        "llama-server": Launched("llama-server", [args.launch_llama_server, "-m", args.gguf, "--embedding",
                                                  "--pooling", args.pooling, "-c", "8192", "-np", "16",
                                                  "--kv-unified", "-b", "2048", "-ub", "2048", "--threads", cores,
                                                  "--host", "127.0.0.1", "--port", str(llama_port)], llama_port),
    }
    results: dict = {}
    try:
        vectors = {}
        for name, server in servers.items():
            await server.wait_healthy(900)
            vectors[name] = await vectors_of(server.base_url, probe)
        cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                   for a, b in zip(vectors["lockgate"], vectors["llama-server"])]
        results["cosine_min"] = min(cosines)
        # timed one server at a time: the other idles
        for name, server in servers.items():
            results[name] = await measure(server.base_url, workloads, args.repeats)
    finally:
        for server in servers.values():
            server.stop()
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"cosine of lockgate's vectors to llama-server's, lowest of {len(probe)}: {results['cosine_min']:.6f}")
    print(f"{'workload':<8} {'lockgate':>22} {'llama-server':>22} {'ratio':>7}")
    for name, unit, key in (("single", "ms/request", "ms_per_request"), ("batch", "inputs/s", "inputs_per_s"),
                            ("long", "tokens/s", "tokens_per_s")):
        ours, theirs = results["lockgate"][name][key], results["llama-server"][name][key]
        ratio = theirs / ours if key == "ms_per_request" else ours / theirs
        print(f"{name:<8} {ours:>12.1f} {unit:<9} {theirs:>12.1f} {unit:<9} {ratio:>6.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
