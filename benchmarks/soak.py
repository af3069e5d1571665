"""A soak with faults: lockgate under a mix of good, bad and rude clients for
a given time, with executor faults injected, checked for anything lost,
changed, leaked or answered 5xx.

It starts its own server (the app `lockgate serve` runs, plus a plugin whose
executor fails one forward pass in N) and drives it at a given concurrency
with:

* normal requests, checked: chat and completions, streamed and not, `n > 1`,
  `response_format` json_schema (output must validate), logprobs (one entry
  per token), stop strings; greedy and seeded ones must equal their
  reference, taken alone before the soak;
* malformed requests (each must get its 4xx), over-long prompts (400
  context_length_exceeded);
* clients that disconnect mid-stream and mid-pipeline, clients that read
  their stream very slowly (their answer must still be whole and equal);
* bursts beyond `--max-queue` (429s, never a 5xx); a normal request that
  meets a full queue gets the same 429 (counted, not a violation: pick
  `--concurrency` below the queue plus the batch for few of them).

A normal request may fail only if an injected fault happened while it ran
(a failed step fails the requests in it, by design); every other 5xx, lost
or changed answer is a violation. At the start, middle and end it reads the
server's RSS, open file descriptors and threads, and the engine's gauges; it
fails on any violation, on gauges not back to 0 at the end, on RSS growing
more than 5 % over the second half, or on descriptors or threads growing.

    python benchmarks/soak.py --minutes 30 --concurrency 64            # the default model
    python benchmarks/soak.py --model tests-tiny --seconds 60          # a tiny random model

Exit status 1 when anything was violated. `tests/test_soak.py` runs it for
60 seconds on the tiny model in the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import dataclasses
import itertools
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------ the server side


def serve(args: argparse.Namespace) -> None:
    """`--serve` mode: the app of `lockgate serve`, with a fault-injecting executor."""
    import faulthandler

    from aiohttp import web

    from lockgate.plugin_api.hookspecs import hookimpl
    from lockgate.logging import configure_logging
    from lockgate.plugin_api.manager import get_plugin_manager
    from lockgate.plugins.tvm import create_executor
    from lockgate.server.app import create_app
    from lockgate.server.config import Settings

    fault_log = open(args.fault_log, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)

    class FaultyExecutor:
        """The real executor, failing every `every`-th forward pass."""

        def __init__(self, real, every: int) -> None:
            self.real, self.every, self.calls = real, every, 0

        def __getattr__(self, name):
            return getattr(self.real, name)

        def _maybe_fail(self, kind: str) -> None:
            self.calls += 1
            if self.every and self.calls % self.every == 0:
                fault_log.write(f"{time.time()} {kind}\n")
                raise RuntimeError(f"injected {kind} fault")

        def prefill(self, seq_ids, token_ids):
            self._maybe_fail("prefill")
            return self.real.prefill(seq_ids, token_ids)

        def decode(self, seq_ids, token_ids):
            self._maybe_fail("decode")
            return self.real.decode(seq_ids, token_ids)

    class FaultInjection:
        @hookimpl
        def lockgate_register_executors(self, register):
            register("faulty-tvm", lambda model_file, options: FaultyExecutor(
                create_executor(model_file, options), args.fault_every))

    settings = Settings.from_env(
        model=args.model_path, served_model_name="soak", port=args.port, executor="faulty-tvm",
        max_queue=args.max_queue, max_num_seqs=args.max_num_seqs, log_format="json", log_level="warning",
    )
    configure_logging(settings.log_format, settings.log_level)
    faulthandler.enable()
    app = create_app(settings, pm=get_plugin_manager(plugins=[FaultInjection()]))
    web.run_app(app, host="127.0.0.1", port=args.port, handler_cancellation=True, access_log=None,
                shutdown_timeout=5, print=None)


# ------------------------------------------------------------------ the client side


@dataclasses.dataclass
class Outcome:
    kind: str
    result: str  # "ok", "4xx-expected", "aborted-by-client", "fault?", or "VIOLATION: ..."
    #: the x-request-id each HTTP request of it was sent with
    request_ids: list[str]


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, pid: int, fault_log: pathlib.Path,
                 server_log: pathlib.Path) -> None:
        self.args = args
        self.base = base
        self.pid = pid
        self.fault_log = fault_log
        self.server_log = server_log
        self.ids = itertools.count()
        #: the request ids the current task sent (one task runs one kind at a time)
        self.sent: contextvars.ContextVar[list[str]] = contextvars.ContextVar("sent")
        self.references: dict[str, Any] = {}
        self.outcomes: list[Outcome] = []
        self.samples: dict[str, dict[str, float]] = {}
        self.rng = random.Random(args.seed)
        self.session: aiohttp.ClientSession | None = None

    # ---- requests of each kind

    def normal_requests(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """The checked requests: name -> (route, body). Greedy or seeded, so
        each has one right answer."""
        chat = [{"role": "user", "content": "Name three colours of the sea, one per line."}]
        story = "Once upon a time, in a small village by the sea, there lived"
        return {
            "chat": (CHAT, {"messages": chat, "max_tokens": 24, "temperature": 0}),
            "chat-stream": (CHAT, {"messages": chat, "max_tokens": 24, "temperature": 0, "stream": True,
                                   "stream_options": {"include_usage": True}}),
            "completion-n2-seeded": (COMPLETIONS, {"prompt": story, "max_tokens": 16, "n": 2,
                                                   "temperature": 0.9, "seed": 7}),
            "completion-n2-seeded-stream": (COMPLETIONS, {"prompt": story, "max_tokens": 16, "n": 2,
                                                          "temperature": 0.9, "seed": 11, "stream": True}),
            "json-schema": (CHAT, {"messages": [{"role": "user", "content": "A person as JSON."}],
                                   "max_tokens": 48, "temperature": 0,
                                   "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "p", "schema": SCHEMA}}}),
            "logprobs-stream": (CHAT, {"messages": chat, "max_tokens": 16, "temperature": 0, "stream": True,
                                       "logprobs": True, "top_logprobs": 2}),
            "stop-strings": (COMPLETIONS, {"prompt": story, "max_tokens": 32, "temperature": 0,
                                           "stop": ["sea,", "\n\n"]}),
            "slow-reader": (COMPLETIONS, {"prompt": story, "max_tokens": 48, "temperature": 0,
                                          "stream": True, "ignore_eos": True}),
        }

    MALFORMED = [
        (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}', 400),
        (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400),
        (CHAT, b'{"model": "soak", "messages": [', 400),
        (CHAT, b'{"model": "soak", "messages": []}', 400),
        (COMPLETIONS, b'{"model": "soak", "prompt": [999999999]}', 400),
        (CHAT, b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404),
        (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "n": 1000}', 400),
    ]

    def request_id(self) -> dict[str, str]:
        """A fresh `x-request-id`, remembered for the task's outcome: the
        server logs the ids of the requests an injected fault failed."""
        request_id = f"soak-{next(self.ids)}"
        self.sent.get([]).append(request_id)
        return {"x-request-id": request_id}

    async def send(self, route: str, body: dict[str, Any]) -> tuple[int, bytes]:
        async with self.session.post(self.base + route, json={"model": "soak", **body},
                                     headers=self.request_id()) as response:
            return response.status, await response.read()

    @staticmethod
    def parse(route: str, body: dict[str, Any], status: int, data: bytes) -> dict[str, Any]:
        """An answer as {choices: {index: text}, finish: {index: reason},
        logprobs: count, error: type or None}, streamed or not."""
        result: dict[str, Any] = {"status": status, "choices": {}, "finish": {}, "logprobs": 0, "error": None,
                                  "done": False}
        if status != 200:
            try:
                result["error"] = json.loads(data)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                result["error"] = f"not OpenAI's error shape: {data[:200]!r}"
            return result
        chat = route == CHAT
        if body.get("stream"):
            for line in data.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    result["done"] = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    result["error"] = chunk["error"]["type"]
                    continue
                for choice in chunk["choices"]:
                    text = (choice["delta"].get("content") or "") if chat else choice["text"]
                    result["choices"][choice["index"]] = result["choices"].get(choice["index"], "") + text
                    if choice.get("finish_reason"):
                        result["finish"][choice["index"]] = choice["finish_reason"]
                    if choice.get("logprobs"):
                        entries = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
                        result["logprobs"] += len(entries)
            return result
        answer = json.loads(data)
        result["done"] = True
        for choice in answer["choices"]:
            result["choices"][choice["index"]] = choice["message"]["content"] if chat else choice["text"]
            result["finish"][choice["index"]] = choice["finish_reason"]
            if choice.get("logprobs"):
                entries = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
                result["logprobs"] += len(entries)
        result["usage"] = answer.get("usage")
        return result

    async def take_references(self) -> None:
        for name, (route, body) in self.normal_requests().items():
            for _attempt in range(5):  # an injected fault may hit the reference run too
                status, data = await self.send(route, body)
                parsed = self.parse(route, body, status, data)
                if status == 200 and parsed["error"] is None and parsed["done"]:
                    self.references[name] = parsed
                    break
            else:
                raise RuntimeError(f"no reference for {name}: {status} {data[:300]!r}")

    async def run_normal(self, name: str) -> str:
        route, body = self.normal_requests()[name]
        if name == "slow-reader":
            status, data = await self.read_slowly(route, body)
        else:
            status, data = await self.send(route, body)
        parsed = self.parse(route, body, status, data)
        if status >= 500 or parsed["error"] == "server_error":
            return "fault?"  # decided against the fault log afterwards
        if status == 429:
            return "refused-busy"  # the queue was full (a burst): the contract's answer
        if status != 200:
            return f"VIOLATION: {status} {parsed['error']} for a normal request"
        if parsed["error"] is not None:
            return f"VIOLATION: error {parsed['error']} inside the stream"
        if not parsed["done"]:
            return "VIOLATION: a stream without [DONE]"
        reference = self.references[name]
        if parsed["choices"] != reference["choices"] or parsed["finish"] != reference["finish"]:
            return f"VIOLATION: changed: {parsed['choices']} != {reference['choices']}"
        if name == "json-schema" and parsed["finish"][0] == "stop":
            value = json.loads(parsed["choices"][0])
            if set(value) != {"name", "age"}:
                return f"VIOLATION: output does not follow the schema: {value}"
        if name == "logprobs-stream" and parsed["logprobs"] != reference["logprobs"]:
            return f"VIOLATION: {parsed['logprobs']} logprob entries, {reference['logprobs']} in the reference"
        return "ok"

    async def read_slowly(self, route: str, body: dict[str, Any]) -> tuple[int, bytes]:
        async with self.session.post(self.base + route, json={"model": "soak", **body},
                                     headers=self.request_id()) as response:
            chunks = []
            async for line in response.content:
                chunks.append(line)
                await asyncio.sleep(self.args.slow_read_delay)
            return response.status, b"".join(chunks)

    async def run_malformed(self) -> str:
        route, data, expected = self.rng.choice(self.MALFORMED)
        async with self.session.post(self.base + route, data=data,
                                     headers={"Content-Type": "application/json", **self.request_id()}) as response:
            answer = await response.read()
        if response.status != expected:
            return f"VIOLATION: malformed request answered {response.status}, not {expected}: {answer[:200]!r}"
        return "4xx-expected"

    async def run_over_long(self) -> str:
        prompt = "the sea " * (self.args.context_length * 2)
        status, data = await self.send(COMPLETIONS, {"prompt": prompt, "max_tokens": 4})
        if status != 400 or b"context_length_exceeded" not in data:
            return f"VIOLATION: an over-long prompt answered {status}: {data[:200]!r}"
        return "4xx-expected"

    async def run_disconnect_mid_stream(self) -> str:
        route, body = self.normal_requests()["chat-stream"]
        async with self.session.post(self.base + route, json={"model": "soak", **body, "max_tokens": 200,
                                                              "ignore_eos": True},
                                     headers=self.request_id()) as response:
            if response.status == 429:
                return "refused-busy"
            if response.status != 200:
                return "fault?" if response.status >= 500 else f"VIOLATION: {response.status}"
            for _ in range(3):
                await response.content.readline()
            response.close()
        return "aborted-by-client"

    async def run_disconnect_mid_pipeline(self) -> str:
        host, port = self.base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": "soak", "messages": [{"role": "user", "content": "word " * 400}],
                           "max_tokens": 64}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await asyncio.sleep(self.rng.uniform(0, 0.05))
        writer.close()
        return "aborted-by-client"

    async def run_burst(self) -> str:
        route, body = CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        # enough at once to overflow the queue whatever else is running
        burst = self.args.max_queue + self.args.max_num_seqs + 16
        answers = await asyncio.gather(*(self.send(route, body) for _ in range(burst)))
        bad = [status for status, _ in answers if status not in (200, 429) and status < 500]
        if bad:
            return f"VIOLATION: a burst got {bad}"
        if any(status >= 500 for status, _ in answers):
            return "fault?"
        if not any(status == 429 for status, _ in answers):
            return "VIOLATION: a burst past --max-queue got no 429"
        return "ok"

    # ---- the mix

    KINDS = {  # kind -> weight
        "chat": 6, "chat-stream": 6, "completion-n2-seeded": 3, "completion-n2-seeded-stream": 3,
        "json-schema": 2, "logprobs-stream": 2, "stop-strings": 3, "slow-reader": 1,
        "malformed": 4, "over-long": 1, "disconnect-mid-stream": 2, "disconnect-mid-pipeline": 2,
    }

    async def one(self, kind: str) -> None:
        sent: list[str] = []
        self.sent.set(sent)
        try:
            if kind in self.references:
                result = await self.run_normal(kind)
            elif kind == "malformed":
                result = await self.run_malformed()
            elif kind == "over-long":
                result = await self.run_over_long()
            elif kind == "disconnect-mid-stream":
                result = await self.run_disconnect_mid_stream()
            elif kind == "disconnect-mid-pipeline":
                result = await self.run_disconnect_mid_pipeline()
            elif kind == "burst":
                result = await self.run_burst()
            else:
                raise ValueError(kind)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            result = f"VIOLATION: lost ({exc!r})"
        self.outcomes.append(Outcome(kind, result, sent))

    async def worker(self, deadline: float) -> None:
        kinds, weights = zip(*self.KINDS.items())
        while time.monotonic() < deadline:
            await self.one(self.rng.choices(kinds, weights)[0])

    async def burster(self, deadline: float) -> None:
        while time.monotonic() < deadline - 5:
            await asyncio.sleep(self.args.burst_every)
            await self.one("burst")

    async def sample(self, label: str) -> None:
        gauges = await self.gauges()
        status = pathlib.Path(f"/proc/{self.pid}/status").read_text()
        field = {line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line}
        self.samples[label] = {
            "rss_mib": int(field["VmRSS"].split()[0]) / 1024,
            "threads": int(field["Threads"]),
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
            **gauges,
        }
        print(f"[{label}] {self.samples[label]}", flush=True)

    async def gauges(self) -> dict[str, float]:
        # a connection of its own, closed after: the sample counts no idle
        # keep-alive connection of this script's
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(self.base + "/metrics") as response:
                text = await response.text()
        found = {}
        for name in ("requests_running", "requests_waiting", "kv_pages_used"):
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(f"lockgate_{name}{{")]
            found[name] = sum(values)
        return found

    async def settle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any((await self.gauges()).values()):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)  # closed connections reach the server

    def client(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout)
        return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def run(self) -> int:
        async with self.client() as self.session:
            await self.take_references()
        # start and end are sampled with every client connection closed
        await self.settle()
        await self.sample("start")
        async with self.client() as self.session:
            start = time.monotonic()
            duration = self.args.seconds
            deadline = start + duration
            tasks = [asyncio.ensure_future(self.worker(deadline)) for _ in range(self.args.concurrency)]
            tasks.append(asyncio.ensure_future(self.burster(deadline)))
            await asyncio.sleep(duration / 2)
            await self.sample("middle")
            await asyncio.gather(*tasks)
        await self.settle()
        await self.sample("end")
        return self.report()

    def failed_by_faults(self) -> set[str]:
        """Ids of the requests the server failed because an injected fault
        broke their engine step (its "executor call failed" log lines)."""
        failed = set()
        for line in self.server_log.read_text(errors="replace").splitlines():
            if '"executor call failed"' not in line or "injected" not in line:
                continue
            for request_id in json.loads(line).get("request_ids", []):
                failed.add(request_id.rsplit("-", 1)[0] if request_id.count("-") > 1 else request_id)
        return failed

    def report(self) -> int:
        faults = []
        if self.fault_log.exists():
            faults = [float(line.split()[0]) for line in self.fault_log.read_text().splitlines() if line.strip()]
        failed_by_faults = self.failed_by_faults()
        violations = []
        table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for outcome in self.outcomes:
            result = outcome.result
            if result == "fault?":
                # a failed step fails the requests in it: allowed only for a
                # request the server logged as failed by an injected fault
                hit = any(request_id in failed_by_faults for request_id in outcome.request_ids)
                result = "failed-by-injected-fault" if hit else "VIOLATION: a 5xx with no injected fault"
            table[outcome.kind][result.split(":")[0]] += 1
            if result.startswith("VIOLATION"):
                violations.append(f"{outcome.kind}: {result}")
        print(f"\n{len(self.outcomes)} requests in {self.args.seconds:.0f} s at concurrency "
              f"{self.args.concurrency}; {len(faults)} faults injected (one forward pass in "
              f"{self.args.fault_every})")
        print(f"{'kind':30} outcomes")
        for kind in sorted(table):
            print(f"{kind:30} {dict(table[kind])}")
        start, middle, end = self.samples["start"], self.samples["middle"], self.samples["end"]
        print(f"\n{'':8} {'RSS MiB':>9} {'fds':>5} {'threads':>8} {'running':>8} {'waiting':>8} {'KV pages':>9}")
        for label, sample in self.samples.items():
            print(f"{label:8} {sample['rss_mib']:9.1f} {sample['fds']:5d} {sample['threads']:8d} "
                  f"{sample['requests_running']:8.0f} {sample['requests_waiting']:8.0f} "
                  f"{sample['kv_pages_used']:9.0f}")
        if any(end[g] for g in ("requests_running", "requests_waiting", "kv_pages_used")):
            violations.append(f"engine gauges not back to 0 at the end: {end}")
        growth = (end["rss_mib"] - middle["rss_mib"]) / middle["rss_mib"]
        print(f"RSS growth over the second half: {growth * 100:+.1f} %")
        if growth > 0.05:
            violations.append(f"RSS grew {growth * 100:.1f} % over the second half")
        # the middle holds the clients' connections; start and end hold none
        if end["fds"] > start["fds"] + 2:
            violations.append(f"open file descriptors grew: {start['fds']} at the start, {end['fds']} at the end")
        if end["threads"] > max(middle["threads"], start["threads"]) + 2:
            violations.append(f"threads grew: {start['threads']} -> {middle['threads']} -> {end['threads']}")
        print()
        if violations:
            print(f"{len(violations)} VIOLATIONS:")
            for line in collections.Counter(violations).most_common(20):
                print("  ", line)
            return 1
        print("no violation")
        return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_path(name: str, workdir: pathlib.Path) -> str:
    if name != "tests-tiny":
        return name
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import write_tiny_gguf

    path = workdir / "tiny.gguf"
    write_tiny_gguf(path)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="a registered model, a GGUF path, or tests-tiny (the tests' random model)")
    duration = parser.add_mutually_exclusive_group()
    duration.add_argument("--minutes", type=float)
    duration.add_argument("--seconds", type=float)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fault-every", type=int, default=200, help="fail one forward pass in N (0: never)")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    parser.add_argument("--slow-read-delay", type=float, default=0.05, help="seconds a slow reader waits per line")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fault-log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0
    args.seconds = args.seconds or (args.minutes or 5) * 60

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="lockgate-soak-"))
    port = free_port()
    fault_log = workdir / "faults.log"
    log = open(workdir / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--model-path", model_path(args.model, workdir),
         "--port", str(port), "--fault-log", str(fault_log), "--fault-every", str(args.fault_every),
         "--max-queue", str(args.max_queue), "--max-num-seqs", str(args.max_num_seqs)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        context_length = asyncio.run(wait_ready(base, server))
        args.context_length = context_length
        print(f"server pid {server.pid} on {base}, log {workdir / 'server.log'}", flush=True)
        code = asyncio.run(Soak(args, base, server.pid, fault_log, workdir / "server.log").run())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    if server.returncode not in (0, -signal.SIGTERM):
        print(f"the server exited with {server.returncode}")
        code = 1
    return code


async def wait_ready(base: str, server: subprocess.Popen) -> int:
    deadline = time.monotonic() + 600
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            try:
                async with session.get(base + "/v1/models") as response:
                    if response.status == 200:
                        card = (await response.json())["data"][0]
                        return int(card["max_model_len"])
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("the server did not start")


if __name__ == "__main__":
    sys.exit(main())
