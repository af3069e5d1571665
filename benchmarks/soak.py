"""A soak: lockgate under a mix of traffic for a given time, checked for
anything lost, changed, leaked or answered 5xx, and for memory that does not
level off.

It starts its own server (the app `lockgate serve` runs, plus a plugin whose
executor can fail one forward pass in N) and drives it with one of two
profiles:

* `mixed` (the default), traffic as users send it: `--concurrency` clients
  sending normal requests well below the queue limit (mostly sampled chat
  streams of 64 tokens; greedy and seeded, so each is checked against its
  reference), slow readers among them; one client looping over malformed
  and oversized requests (bodies up to the size limit and past it,
  million-character strings, deeply nested JSON, schemas the grammar
  compiler refuses, wrong types: each must get its own 4xx); and waves of 8
  clients that open long streams and hang up after 1.5 s. No injected
  faults unless `--fault-every` says so.
* `faults`: the normal requests of every kind (chat and completions,
  streamed or not, `n > 1`, json_schema, logprobs, stop strings) with
  malformed and over-long requests, clients that disconnect mid-stream and
  mid-pipeline, slow readers and bursts past `--max-queue`, at a given
  concurrency, with one forward pass in `--fault-every` failing.

A normal request may fail only if an injected fault happened while it ran
(a failed step fails the requests in it, by design); every other 5xx, lost
or changed answer is a violation. Every `--sample-every` seconds it reads the
server's RSS, open file descriptors and threads, and the engine's gauges; it
fails on any violation, on gauges not back to 0 at the end, on the C
allocator's memory in use growing more than `--max-growth` % over the second
half or resident memory more than `--max-rss-growth` % (each the lowest of
that half's last fifth of samples, ten at least, against the lowest of its
first fifth: memory saws with the traffic and the trims, and a leak raises
its floor), or on descriptors or threads growing.

    python benchmarks/soak.py --minutes 30                                     # mixed, the default model
    python benchmarks/soak.py --profile faults --minutes 30 --concurrency 64   # with faults
    python benchmarks/soak.py --model tests-tiny --seconds 60                  # a tiny random model

Exit status 1 when anything was violated. `tests/e2e/test_soak.py` runs both
profiles for a minute on the tiny model in the test suite.
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
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from load import free_port  # noqa: E402 (beside this script)
from soak_requests import (  # noqa: E402 (beside this script, not a package)
    CHAT, COMPLETIONS, MALFORMED, WHOLE_NOT_EQUAL, normal_requests, oversized_and_malformed, parse,
)


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

    async def take_references(self) -> None:
        for name, (route, body) in normal_requests().items():
            for _attempt in range(5):  # an injected fault may hit the reference run too
                status, data = await self.send(route, body)
                parsed = parse(route, body, status, data)
                if status == 200 and parsed["error"] is None and parsed["done"]:
                    self.references[name] = parsed
                    break
            else:
                raise RuntimeError(f"no reference for {name}: {status} {data[:300]!r}")

    async def run_normal(self, name: str) -> str:
        route, body = normal_requests()[name]
        if name == "slow-reader":
            status, data = await self.read_slowly(route, body)
        else:
            status, data = await self.send(route, body)
        parsed = parse(route, body, status, data)
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
        if name in WHOLE_NOT_EQUAL:
            if set(parsed["finish"]) != set(reference["finish"]) or not all(parsed["choices"].values()):
                return f"VIOLATION: not every choice came whole: {parsed['choices']} {parsed['finish']}"
        elif parsed["choices"] != reference["choices"] or parsed["finish"] != reference["finish"]:
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
        return await self.run_malformed_body(*self.rng.choice(MALFORMED))

    async def run_over_long(self) -> str:
        prompt = "the sea " * (self.args.context_length * 2)
        status, data = await self.send(COMPLETIONS, {"prompt": prompt, "max_tokens": 4})
        if status != 400 or b"context_length_exceeded" not in data:
            return f"VIOLATION: an over-long prompt answered {status}: {data[:200]!r}"
        return "4xx-expected"

    async def run_disconnect_mid_stream(self) -> str:
        return await self.run_hang_up(after_lines=3)

    async def run_hang_up(self, *, after_lines: int | None = None, after_seconds: float | None = None) -> str:
        """A client that opens a long stream and hangs up: once it has read
        `after_lines` lines, or `after_seconds` in."""
        route, body = normal_requests()["chat-stream"]
        async with self.session.post(self.base + route, json={"model": "soak", **body, "max_tokens": 400,
                                                              "ignore_eos": True},
                                     headers=self.request_id()) as response:
            if response.status == 429:
                return "refused-busy"
            if response.status != 200:
                return "fault?" if response.status >= 500 else f"VIOLATION: {response.status}"
            started, lines = time.monotonic(), 0
            async for _ in response.content:
                lines += 1
                if lines == after_lines or after_seconds is not None and time.monotonic() - started > after_seconds:
                    break
            response.close()
        return "aborted-by-client"

    async def run_malformed_body(self, route: str, data: bytes, expected: int) -> str:
        async with self.session.post(self.base + route, data=data,
                                     headers={"Content-Type": "application/json", **self.request_id()}) as response:
            answer = await response.read()
        if response.status != expected:
            return f"VIOLATION: answered {response.status}, not {expected}: {data[:80]!r} -> {answer[:200]!r}"
        return "4xx-expected"

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

    #: what a worker sends, by profile: kind -> weight
    KINDS = {
        "faults": {
            "chat": 6, "chat-stream": 6, "completion-n2-seeded": 3, "completion-n2-seeded-stream": 3,
            "json-schema": 2, "logprobs-stream": 2, "stop-strings": 3, "slow-reader": 1,
            "malformed": 4, "over-long": 1, "disconnect-mid-stream": 2, "disconnect-mid-pipeline": 2,
        },
        # beside its own loops of malformed requests and hang-ups
        "mixed": {
            "chat-stream-sampled": 12, "chat-stream": 2, "chat": 2, "completion-n2-seeded-stream": 1,
            "json-schema": 1, "logprobs-stream": 1, "stop-strings": 1, "slow-reader": 1,
        },
    }

    async def one(self, kind: str, run=None) -> None:
        """Send one request of `kind` (with `run`, that coroutine function
        sends it) and record its outcome."""
        sent: list[str] = []
        self.sent.set(sent)
        try:
            if run is not None:
                result = await run()
            elif kind in self.references:
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
        kinds, weights = zip(*self.KINDS[self.args.profile].items())
        while time.monotonic() < deadline:
            await self.one(self.rng.choices(kinds, weights)[0])

    async def malformed_loop(self, deadline: float) -> None:
        """One client sending malformed and oversized requests back to back."""
        bodies = oversized_and_malformed(self.args.max_body_size)
        while time.monotonic() < deadline:
            for route, data, expected in bodies:
                if time.monotonic() >= deadline:
                    return
                await self.one("malformed-or-oversized", lambda: self.run_malformed_body(route, data, expected))

    async def hang_up_waves(self, deadline: float) -> None:
        """Waves of 8 clients that open long streams and hang up 1.5 s in."""
        while time.monotonic() < deadline - 2:
            await asyncio.gather(*(self.one("hang-up", lambda: self.run_hang_up(after_seconds=1.5)) for _ in range(8)))
            await asyncio.sleep(2)

    async def sampler(self, start: float, deadline: float) -> None:
        every = self.args.sample_every or max(5.0, self.args.seconds / 60)
        while True:
            await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            await self.sample(f"{time.monotonic() - start:.0f} s")

    async def burster(self, deadline: float) -> None:
        while time.monotonic() < deadline - 5:
            await asyncio.sleep(self.args.burst_every)
            await self.one("burst")

    async def sample(self, label: str) -> None:
        gauges = await self.gauges()
        status = pathlib.Path(f"/proc/{self.pid}/status").read_text()
        field = {line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line}
        self.samples[label] = {
            "at": time.monotonic(),
            "rss_mib": int(field["VmRSS"].split()[0]) / 1024,
            "threads": int(field["Threads"]),
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
            **gauges,
        }
        print(f"[{label}] {({k: v for k, v in self.samples[label].items() if k != 'at'})}", flush=True)

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
        for name in ("allocator_in_use_bytes", "allocator_free_bytes"):
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(f"lockgate_{name} ")]
            found[name.replace("_bytes", "_mib")] = sum(values) / 2**20
        return found

    async def settle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(value for name, value in (await self.gauges()).items()
                                                  if not name.startswith("allocator")):
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
            self.half = start + duration / 2
            loops = [self.worker(deadline) for _ in range(self.args.concurrency)]
            if self.args.profile == "faults":
                loops.append(self.burster(deadline))
            else:
                loops += [self.malformed_loop(deadline), self.hang_up_waves(deadline)]
            await asyncio.gather(self.sampler(start, deadline), *loops)
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

    def floor_growth(self, key: str) -> tuple[float, float, float, int]:
        """How much the floor of a memory figure rose over the run's second
        half: the lowest sample of that half's first fifth against the lowest
        of its last fifth. Memory saws up and down with the requests in
        flight and the trims; what a leak raises is the floor it comes back
        to (a median can fall on a crest at one end and a trough at the
        other). A fifth is at least ten samples when the half has twenty or
        more: a floor needs a moment with little in flight, and once a
        minute's last six samples (one a second) all fell on oversized
        bodies being read, 4.4 MiB above the floor the server had come back
        to seconds earlier."""
        end = self.samples["end"]
        second_half = [s[key] for label, s in self.samples.items()
                       if label not in ("start", "end") and s["at"] >= self.half] or [end[key]]
        window = max(1, len(second_half) // 5, min(10, len(second_half) // 2))
        began, ended = min(second_half[:window]), min(second_half[-window:])
        return (ended - began) / began, began, ended, window

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
        print(f"\n{len(self.outcomes)} requests in {self.args.seconds:.0f} s, profile {self.args.profile}, at "
              f"concurrency {self.args.concurrency}; {len(faults)} faults injected (one forward pass in "
              f"{self.args.fault_every or 'never'})")
        print(f"{'kind':30} outcomes")
        for kind in sorted(table):
            print(f"{kind:30} {dict(table[kind])}")
        start, end = self.samples["start"], self.samples["end"]
        print(f"\n{'':8} {'RSS MiB':>9} {'in use':>8} {'kept':>8} {'fds':>5} {'threads':>8} {'running':>8} "
              f"{'waiting':>8} {'KV pages':>9}")
        for label, sample in self.samples.items():
            print(f"{label:8} {sample['rss_mib']:9.1f} {sample.get('allocator_in_use_mib', 0):8.1f} "
                  f"{sample.get('allocator_free_mib', 0):8.1f} {sample['fds']:5d} {sample['threads']:8d} "
                  f"{sample['requests_running']:8.0f} {sample['requests_waiting']:8.0f} "
                  f"{sample['kv_pages_used']:9.0f}")
        if any(end[g] for g in ("requests_running", "requests_waiting", "kv_pages_used")):
            violations.append(f"engine gauges not back to 0 at the end: {end}")
        # Two memory figures, each bounded over the second half. The
        # allocator's memory in use is what a leak raises; resident memory
        # also holds what glibc keeps after frees until a trim, which saws
        # by a fifth of a small server's RSS within seconds (+12 to +16 % in
        # clean one-minute runs that leaked nothing, while the in-use floor
        # moved by 0.1 %). Resident memory is what users see, so it is
        # bounded too: tightly in a long run, loosely in a minute.
        checks = [("RSS", "rss_mib", self.args.max_rss_growth, 0.0)]
        if "allocator_in_use_mib" in end:
            checks.append(("allocator memory in use", "allocator_in_use_mib", self.args.max_growth,
                           self.args.max_growth_mib))
        for name, key, bound, slack in checks:
            growth, began, ended, window = self.floor_growth(key)
            allowed = f"at most {bound} %" + (f" or {slack:g} MiB" if slack else "")
            print(f"{name} growth over the second half: {growth * 100:+.1f} % (lowest of {window} sample(s): "
                  f"{began:.1f} MiB as it began, {ended:.1f} MiB as it ended; {allowed})")
            if growth * 100 > bound and ended - began > slack:
                violations.append(f"{name} grew {growth * 100:.1f} % over the second half ({allowed})")
        # the middle holds the clients' connections; start and end hold none
        if end["fds"] > start["fds"] + 2:
            violations.append(f"open file descriptors grew: {start['fds']} at the start, {end['fds']} at the end")
        most_threads = max(s["threads"] for label, s in self.samples.items() if label != "end")
        if end["threads"] > most_threads + 2:
            violations.append(f"threads grew: {start['threads']} -> {most_threads} -> {end['threads']}")
        print()
        if violations:
            print(f"{len(violations)} VIOLATIONS:")
            for line in collections.Counter(violations).most_common(20):
                print("  ", line)
            return 1
        print("no violation")
        return 0


def model_path(name: str, workdir: pathlib.Path) -> str:
    if name != "tests-tiny":
        return name
    sys.path.insert(0, str(ROOT / "tests" / "support"))
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
    parser.add_argument("--profile", choices=("mixed", "faults"), default="mixed")
    parser.add_argument("--concurrency", type=int, help="clients sending normal requests (mixed: 24, faults: 16)")
    parser.add_argument("--fault-every", type=int,
                        help="fail one forward pass in N, 0 never (mixed: 0, faults: 200)")
    parser.add_argument("--sample-every", type=float,
                        help="seconds between samples (default: a sixtieth of the run, at least 5)")
    parser.add_argument("--max-growth", type=float, default=3.0,
                        help="percent the allocator's memory in use may grow over the second half")
    parser.add_argument("--max-growth-mib", type=float, default=0.0,
                        help="MiB the allocator's memory in use may grow over the second half whatever the "
                             "percentage (a short run on a small model is still warming its caches)")
    parser.add_argument("--max-rss-growth", type=float,
                        help="percent resident memory may grow over the second half (default: --max-growth)")
    parser.add_argument("--max-body-size", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    parser.add_argument("--slow-read-delay", type=float, default=0.05, help="seconds a slow reader waits per line")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.seconds = args.seconds or (args.minutes or 5) * 60
    args.max_rss_growth = args.max_growth if args.max_rss_growth is None else args.max_rss_growth
    mixed = args.profile == "mixed"
    args.concurrency = args.concurrency or (24 if mixed else 16)
    args.fault_every = (0 if mixed else 200) if args.fault_every is None else args.fault_every

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="lockgate-soak-"))
    port = free_port()
    fault_log = workdir / "faults.log"
    log = open(workdir / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "soak_server.py"), "--model-path", model_path(args.model, workdir),
         "--port", str(port), "--fault-log", str(fault_log), "--fault-every", str(args.fault_every),
         "--max-queue", str(args.max_queue), "--max-num-seqs", str(args.max_num_seqs),
         "--max-body-size", str(args.max_body_size)],
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
