"""The soak with faults (`benchmarks/soak.py`) for 60 seconds on the tiny
model: good, malformed, disconnecting and slow clients at once, one forward
pass in 150 failing, and nothing lost, changed, leaked or answered 5xx."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_60_second_soak_with_faults_finds_nothing():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", "tests-tiny", "--seconds", "60",
         "--concurrency", "12", "--fault-every", "150", "--max-queue", "16", "--max-num-seqs", "4",
         "--burst-every", "15"],
        capture_output=True, text=True, timeout=600,
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "no violation" in result.stdout
    # every kind of client was exercised, the faults too
    for kind in ("chat-stream", "completion-n2-seeded", "json-schema", "malformed", "disconnect-mid-stream",
                 "disconnect-mid-pipeline", "slow-reader", "over-long", "burst"):
        assert f"\n{kind} " in result.stdout, kind
    injected = int(result.stdout.split(" faults injected")[0].rsplit("; ", 1)[1])
    assert injected > 0
