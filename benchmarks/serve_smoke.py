"""Start-up and single-stream speed of `lockgate serve`, measured as a user sees them.

Starts the server twice on the same fresh compile cache (cold: compiles; warm:
cached), timing process start to `/health` 200, then streams one greedy
completion through the openai SDK and reports time to first token and decode
tokens per second (batch 1).

    python benchmarks/serve_smoke.py [--model M] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import free_port  # noqa: E402 (beside this script, not a package)


def start_server(model: str, cache_dir: str, port: int) -> tuple[subprocess.Popen, float]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", model, "--port", str(port),
         "--cache-dir", cache_dir, "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    while True:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, time.perf_counter() - started
        except OSError:
            time.sleep(0.1)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def stream_once(port: int, tokens: int) -> tuple[float, float, int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    started = time.perf_counter()
    first = None
    chunks = 0
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        chunks += 1
        usage = chunk.usage or usage
    end = time.perf_counter()
    generated = usage.completion_tokens
    return first - started, (generated - 1) / (end - first), generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        port = free_port()
        process, cold = start_server(args.model, cache_dir, port)
        stop_server(process)
        process, warm = start_server(args.model, cache_dir, port)
        try:
            stream_once(port, 8)  # warm-up
            ttft, tok_s, generated = stream_once(port, args.tokens)
        finally:
            stop_server(process)
    print(f"model                    {args.model}")
    print(f"cores                    {os.cpu_count()}")
    print(f"cold start (compile)     {cold:6.1f} s")
    print(f"warm start (cached)      {warm:6.1f} s")
    print(f"time to first token      {ttft * 1000:6.1f} ms")
    print(f"decode, batch 1          {tok_s:6.1f} tok/s over {generated} tokens")


if __name__ == "__main__":
    main()
