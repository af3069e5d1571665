"""Speculative decoding: batch-1 decode speed with it on and off, and
against llama.cpp's own n-gram speculation, on the same GGUF file.

Starts each server in turn (lockgate with speculation, lockgate with
`--no-speculation`, and, given `--launch-llama-server`, llama-server with
and without `--spec-type ngram-simple`), and sends each scenario one
request at a time, greedy, streamed:

* `copy: paragraph` / `copy: code`: rewrite a given paragraph or code
  block with one change (what prompt lookup is for);
* `copy: code + prediction`: the same, with the original as OpenAI's
  `prediction` (lockgate only);
* `tool call`: a function call the tool grammar forces the envelope of;
* `open chat`: a story, where drafts have little to copy from.

Each row gives tokens a second over the whole request (the prompt is in
each server's prompt cache from the second repeat on; median of
`--repeats`), and for lockgate the share of drafts accepted (from
`/metrics`). A pause (`--pause`, 1 s) goes before each request: this
llama-server build with `--spec-type ngram-simple` exits when a request
follows the last at once. Greedy output must be the same with
speculation on and off: the script says where it is not.

`--executor-costs` measures, in this process, what a verification of
1 + k rows costs against a decode step on the model (batch 1, 2 and 4):
the ratio the policy weighs acceptance against.

    python benchmarks/speculation.py --gguf PATH \\
        [--launch-llama-server /path/to/llama-server] [--executor-costs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import shlex
import statistics
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from load import Launched, free_port  # noqa: E402

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships "
    "passing in the dark saw its beam sweep across the water and knew where the rocks were. When the keeper "
    "grew old, his daughter took over the work, and she kept the light burning through storms, fog and the "
    "long winter nights."
)
CODE = '''def load_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    with open(path, "w") as handle:
        for key, value in sorted(config.items()):
            handle.write(f"{key} = {value}\\n")
'''
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}

SCENARIOS = {
    "copy: paragraph": {"messages": [{"role": "user", "content":
        "Rewrite this paragraph exactly, but call the keeper's daughter Mary:\n\n" + PARAGRAPH}]},
    "copy: code": {"messages": [{"role": "user", "content":
        "Rewrite this code with the variable `handle` renamed to `f`. Reply with the code only.\n\n"
        "```python\n" + CODE + "```"}]},
    "copy: code + prediction": {"messages": [{"role": "user", "content":
        "Rewrite this code with the variable `handle` renamed to `f`. Reply with the code only.\n\n"
        "```python\n" + CODE + "```"}], "prediction": {"type": "content", "content": "```python\n" + CODE + "```"},
        "lockgate_only": True},
    "tool call": {"messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
                  "tools": [WEATHER], "tool_choice": "required"},
    "open chat": {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]},
}


async def stream_chat(session: aiohttp.ClientSession, url: str, model: str, scenario: dict, max_tokens: int):
    """(text, tokens out, the request's seconds, usage)."""
    body = {k: v for k, v in scenario.items() if k != "lockgate_only"}
    body.update(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
    text, usage = [], {}
    started = time.perf_counter()
    async with session.post(f"{url}/chat/completions", json=body) as response:
        if response.status != 200:
            raise SystemExit(f"error: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta", {})
                piece = (delta.get("content") or "") + json.dumps(delta.get("tool_calls") or "")[1:-1]
                text.append(piece)
    return "".join(text), usage.get("completion_tokens", 0), time.perf_counter() - started, usage


async def metric_counts(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    async with session.get(f"{base}/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    drafted = sum(float(v) for v in re.findall(r"^lockgate_speculative_drafted_tokens_total\{[^}]*\} (\S+)", text, re.M))
    accepted = sum(float(v) for v in re.findall(r"^lockgate_speculative_accepted_tokens_total\{[^}]*\} (\S+)", text, re.M))
    return drafted, accepted


def servers(args) -> list[tuple[str, list[str], int]]:
    cores = str(os.cpu_count() or 1)
    commands = []
    for label, extra in (("lockgate, speculation", []), ("lockgate, none", ["--no-speculation"])):
        port = free_port()
        commands.append((label, [sys.executable, "-m", "lockgate.server.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--model", args.gguf, *extra,
                                 *shlex.split(args.lockgate_args)], port))
    if args.launch_llama_server:
        for label, extra in (("llama-server, ngram-simple", ["--spec-type", "ngram-simple"]),
                             ("llama-server, none", [])):
            port = free_port()
            commands.append((label, [args.launch_llama_server, "-m", args.gguf, "-np", "1", "-c", "4096",
                                     "--threads", cores, "--host", "127.0.0.1", "--port", str(port), "--jinja",
                                     *extra, *shlex.split(args.llama_args)], port))
    return commands


async def benchmark(args) -> dict:
    results: dict[str, dict[str, dict]] = {}
    for label, command, port in servers(args):
        server = Launched(label.split(",")[0], command, port)
        print(f"starting {label}: {shlex.join(command)}", flush=True)
        lockgate = label.startswith("lockgate")
        try:
            await server.wait_healthy(args.launch_timeout)
            base = server.base_url.removesuffix("/v1")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                model = "smollm2" if lockgate else "default"
                if lockgate:
                    async with session.get(f"{server.base_url}/models") as response:
                        model = (await response.json())["data"][0]["id"]
                await stream_chat(session, server.base_url, model, SCENARIOS["open chat"], 8)  # warm-up
                results[label] = {}
                for name, scenario in SCENARIOS.items():
                    if scenario.get("lockgate_only") and not lockgate:
                        continue
                    before = await metric_counts(session, base) if lockgate else (0, 0)
                    rates, text, usage = [], "", {}
                    for _ in range(args.repeats):
                        await asyncio.sleep(args.pause)
                        text, tokens, seconds, usage = await stream_chat(session, server.base_url, model, scenario,
                                                                         args.max_tokens)
                        rates.append(tokens / seconds)
                    after = await metric_counts(session, base) if lockgate else (0, 0)
                    drafted, accepted = after[0] - before[0], after[1] - before[1]
                    results[label][name] = {"tok_s": statistics.median(rates), "tokens": usage.get(
                        "completion_tokens"), "text": text, "drafted": drafted, "accepted": accepted,
                        "details": usage.get("completion_tokens_details")}
                    share = f", {accepted:.0f} of {drafted:.0f} drafts accepted" if drafted else ""
                    print(f"  {name}: {statistics.median(rates):.1f} tok/s ({usage.get('completion_tokens')} tokens"
                          f"{share})", flush=True)
        finally:
            server.stop()
    return results


def same_output(a: str, b: str) -> bool:
    """Equal but for the random ids of tool calls."""
    def ids(text):
        return re.sub(r'"call_[0-9A-Za-z]+"', '"call"', text)
    return ids(a) == ids(b)


def report(results: dict, args) -> None:
    labels = list(results)
    print(f"\nbatch 1, greedy, up to {args.max_tokens} tokens, median of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f}, {pathlib.Path(args.gguf).name}\n")
    print("| scenario | " + " | ".join(labels) + " | speculation / none (lockgate) |"
          + (" ngram / none (llama-server) | lockgate spec / llama ngram |" if len(labels) > 2 else ""))
    print("|---" * (len(labels) + (4 if len(labels) > 2 else 2)) + "|")
    for name in SCENARIOS:
        row = [results[label].get(name) for label in labels]
        cells = ["—" if r is None else f"{r['tok_s']:.1f}" for r in row]
        on, off = results[labels[0]].get(name), results[labels[1]].get(name)
        line = f"| {name} | " + " | ".join(cells) + f" | {on['tok_s'] / off['tok_s']:.2f}x |"
        if len(labels) > 2:
            ngram, none = results[labels[2]].get(name), results[labels[3]].get(name)
            line += (" — | — |" if ngram is None else
                     f" {ngram['tok_s'] / none['tok_s']:.2f}x | {on['tok_s'] / ngram['tok_s']:.2f}x |")
        print(line)
    print()
    for name in SCENARIOS:
        on, off = results[labels[0]].get(name), results[labels[1]].get(name)
        same = same_output(on["text"], off["text"])
        share = f"{on['accepted'] / on['drafted']:.0%} of {on['drafted']:.0f} drafts accepted" if on["drafted"] else \
            "nothing drafted"
        print(f"{name}: greedy output {'identical' if same else 'DIFFERENT'} on and off; {share}"
              + (f"; usage {on['details']}" if on.get("details") else ""))


def executor_costs(args) -> None:
    from lockgate.models.loading import load_model
    from lockgate.plugin_api.manager import get_plugin_manager

    model = load_model(get_plugin_manager(), args.gguf)
    executor, rng = model.executor, np.random.default_rng(0)

    def median_ms(fn, repeats=30):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    ks = (1, 2, 3, 4, 6, 8)
    print(f"\nverification of 1 + k rows against a decode step, {pathlib.Path(args.gguf).name}, "
          f"after a 300-token prompt\n")
    print("| batch | decode | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---" * (len(ks) + 2) + "|")
    for batch in (1, 2, 4):
        ids = list(range(10, 10 + batch))
        for seq in ids:
            executor.add_sequence(seq)
            executor.prefill([seq], [rng.integers(100, 10000, 300).tolist()])

        def decode():
            executor.decode(ids, [5] * batch)
            for seq in ids:
                executor.truncate(seq, 300)

        base = median_ms(decode)
        cells = []
        for k in ks:
            def verify():
                executor.prefill(ids, [[5] * (k + 1)] * batch, [True] * batch)
                for seq in ids:
                    executor.truncate(seq, 300)
            cells.append(f"{median_ms(verify) / base:.2f}x")
        print(f"| {batch} | {base:.2f} ms | " + " | ".join(cells) + " |", flush=True)
        for seq in ids:
            executor.remove_sequence(seq)
    model.executor.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the model file both servers load")
    parser.add_argument("--launch-llama-server", help="path to llama-server, to compare its n-gram speculation")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds before each request")
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--lockgate-args", default="", help="more `lockgate serve` flags")
    parser.add_argument("--llama-args", default="", help="more llama-server flags")
    parser.add_argument("--executor-costs", action="store_true", help="also the verify/decode cost table")
    parser.add_argument("--no-servers", action="store_true", help="the cost table only")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure here")
    args = parser.parse_args(argv)
    if not args.no_servers:
        results = asyncio.run(benchmark(args))
        report(results, args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    if args.executor_costs or args.no_servers:
        executor_costs(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
