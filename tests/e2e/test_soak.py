"""The soak (`benchmarks/soak.py`) for a minute on the tiny model, in both
profiles: traffic mixed as users send it (normal streams, a loop of
malformed and oversized requests, hang-ups), and the one with faults (one
forward pass in 150 failing, bursts past the queue). Nothing lost, changed,
leaked or answered 5xx; memory that levels off."""

from __future__ import annotations

import pytest

import subprocess
import sys

from paths import ROOT

pytestmark = pytest.mark.slow


def soak(*args: str, seconds: int = 60) -> str:
    # a sample a second: the growth check compares medians of the second
    # half's first and last fifth, which at the default of one sample in 5 s
    # are single samples (one failed at +12 % between a dip and a peak)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", "tests-tiny", "--seconds", str(seconds),
         "--sample-every", "1", *args],
        capture_output=True, text=True, timeout=600,
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "no violation" in result.stdout
    return result.stdout


def test_a_60_second_mixed_soak_finds_nothing():
    # What a leak raises, the allocator's memory in use, has a floor that
    # moved 0.1 % over a clean minute's second half. Resident memory saws by
    # a fifth within seconds here (freed memory kept until a trim: +12 to
    # +16 % in clean minutes), so a minute bounds it only loosely; the tight
    # bound on it (3 %) is for the 30-minute run.
    out = soak("--max-growth", "5", "--max-rss-growth", "30")
    assert "allocator memory in use growth over the second half" in out
    for kind in ("chat-stream-sampled", "malformed-or-oversized", "hang-up", "slow-reader"):
        assert f"\n{kind} " in out, kind
    assert "{'4xx-expected'" in out.split("\nmalformed-or-oversized ")[1].splitlines()[0]


def test_a_90_second_soak_with_faults_finds_nothing():
    # The tiny server's allocator holds ~30 MiB, its KV pools outside it (it
    # held ~286 MiB with TVM's cache, whose workspace malloc counted). Its
    # caches warm by 4-5 MiB over the first 40 s or so, then level off: a
    # minute's second half caught that warming on a 2 vCPU EPYC (+4.3 MiB,
    # the code before several models included), where 150 s measured -1.6 %
    # over their second half; 90 s leaves the warming in the first.
    out = soak("--profile", "faults", "--concurrency", "12", "--fault-every", "150", "--max-queue", "16",
               "--max-num-seqs", "4", "--burst-every", "15", "--max-growth", "5", "--max-growth-mib", "4",
               "--max-rss-growth", "30", seconds=90)
    # every kind of client was exercised, the faults too
    for kind in ("chat-stream", "completion-n2-seeded", "json-schema", "malformed", "disconnect-mid-stream",
                 "disconnect-mid-pipeline", "slow-reader", "over-long", "burst"):
        assert f"\n{kind} " in out, kind
    injected = int(out.split(" faults injected")[0].rsplit("; ", 1)[1])
    assert injected > 0
