"""The property-based fuzzer against a real `lockgate serve` of the tiny model.

A few hundred generated bodies (`tests/support/fuzzing.py`), from a fixed seed so a
CI run is repeatable, each sent over TCP to a server in its own process: a
crash of native code kills that process and fails the test instead of the
test run. Afterwards a normal request succeeds and the engine holds nothing.
`benchmarks/fuzz.py` runs the same cases for as long as asked against any URL.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from fuzzing import CHAT, Case, cases, check_answer, send
from processes import free_port, stop

pytestmark = pytest.mark.slow

#: per-request deadline: a hang is a failure, not a slow test
DEADLINE_SECONDS = 30
EXAMPLES = 1000


@pytest.fixture(scope="module")
def fuzz_server(tiny_gguf, tmp_path_factory):
    """`lockgate serve` of the tiny model, its log in a file: a pipe nobody
    reads fills up after a few hundred requests' log lines and then blocks
    the server."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("fuzz") / "server.log"
    with open(log_path, "w") as log:
        # small limits so that overflows are reached by the fuzzer, not avoided
        process = subprocess.Popen(
            [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", str(tiny_gguf),
             "--served-model-name", "tiny", "--port", str(port), "--max-queue", "8", "--max-num-seqs", "4"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not become healthy"
                time.sleep(0.3)
        yield process, port
    finally:
        code, _ = stop(process)
        print("server log, last lines:\n" + "\n".join(log_path.read_text().splitlines()[-20:]))
    assert code == 0, f"the server exited with {code} after the fuzzing"


def engine_gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    gauges = {}
    for name in ("lockgate_requests_running", "lockgate_requests_waiting", "lockgate_kv_pages_used"):
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
        gauges[name] = sum(values)
    return gauges


def assert_serving_and_idle(process, port: int) -> None:
    assert process.poll() is None, f"the server died with {process.returncode}"
    case = Case("POST", CHAT, json.dumps({"model": "tiny", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": "hi"}]}).encode(),
                "application/json", "a normal request")
    status, headers, data = send("127.0.0.1", port, case, timeout=DEADLINE_SECONDS)
    assert status == 200, data
    deadline = time.monotonic() + 30
    while (gauges := engine_gauges(port)) and any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(gauges.values()), gauges


def test_no_generated_request_gets_a_5xx_a_malformed_answer_or_no_answer(fuzz_server):
    process, port = fuzz_server
    outcomes: collections.Counter[str] = collections.Counter()
    recent: collections.deque = collections.deque(maxlen=4)

    # No shrinking: the server keeps state, so a request that wedges it fails
    # every later one, and shrinking would end on an innocent body. The
    # cases sent just before a failure are in its message instead.
    @seed(20261130)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(model="tiny"))
    def fuzz(case):
        recent.append(case)
        try:
            status, headers, data = send("127.0.0.1", port, case, timeout=DEADLINE_SECONDS)
            outcomes[check_answer(case, status, headers, data)] += 1
        except AssertionError as failure:
            before = "\n".join(c.describe() for c in list(recent)[:-1])
            raise AssertionError(f"{failure}\n\ncases sent just before:\n{before}") from None
        assert process.poll() is None, f"the server died with {process.returncode} on {case.describe()}"

    fuzz()
    print("outcomes:", dict(outcomes))
    # the generator reaches both sides of the gate
    assert outcomes["ok"] + outcomes["ok-stream"] > EXAMPLES // 10, outcomes
    assert outcomes["400"] > EXAMPLES // 10, outcomes
    assert_serving_and_idle(process, port)


@pytest.mark.parametrize("stream", [False, True])
def test_schemas_aimed_at_the_grammar_compiler(fuzz_server, stream):
    """Every hostile schema, each to the same live process: deep `$ref`
    chains, pathological regexes, sizes past llguidance's limits. A native
    crash ends the server and fails here, not the test run."""
    from fuzzing import HOSTILE_SCHEMAS

    process, port = fuzz_server
    seen = collections.Counter()
    for i, schema in enumerate(HOSTILE_SCHEMAS):
        body = {"model": "tiny", "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        case = Case("POST", CHAT, json.dumps(body).encode(), "application/json", f"hostile schema {i}", body)
        status, headers, data = send("127.0.0.1", port, case, timeout=DEADLINE_SECONDS)
        seen[check_answer(case, status, headers, data)] += 1
        assert process.poll() is None, f"the server died with {process.returncode} on hostile schema {i}"
    assert seen["400"] >= len(HOSTILE_SCHEMAS) // 2, seen
    assert_serving_and_idle(process, port)


@pytest.mark.parametrize("field", ["guided_regex", "grammar", "structured_outputs"])
def test_grammars_aimed_at_the_grammar_compiler(fuzz_server, field):
    """Every hostile regular expression and grammar, through each way a
    client names one (vLLM's, llama.cpp's, vLLM's newer), to the same live
    process: a 400 naming the field or an answer, never a 5xx or a crash."""
    from fuzzing import HOSTILE_GRAMMARS

    process, port = fuzz_server
    seen = collections.Counter()
    for i, text in enumerate(HOSTILE_GRAMMARS):
        value = {"grammar": text} if field == "structured_outputs" else text
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], field: value}
        case = Case("POST", CHAT, json.dumps(body).encode(), "application/json", f"hostile grammar {i}", body)
        status, headers, data = send("127.0.0.1", port, case, timeout=DEADLINE_SECONDS)
        outcome = check_answer(case, status, headers, data)
        seen[outcome] += 1
        if outcome == "400":
            assert json.loads(data)["error"]["param"].startswith(field), data
        assert process.poll() is None, f"the server died with {process.returncode} on hostile grammar {i}"
    assert seen["400"] >= len(HOSTILE_GRAMMARS) // 3, seen
    assert_serving_and_idle(process, port)
