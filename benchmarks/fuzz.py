"""Fuzz a running lockgate (or any OpenAI-compatible server) for as long as asked.

The same generated cases and the same property as the test suite's fuzzer
(`tests/support/fuzzing.py`): every answer is a 200 with a well-formed body or a 4xx
in OpenAI's error shape; never a 5xx, never a server fault inside a stream,
never silence past the deadline. Stops at the first violation and prints it
with the cases sent just before it (a server wedged by one request fails the
ones after it), or at the end prints the outcomes counted.

    lockgate serve --port 8000 &
    python benchmarks/fuzz.py --url http://127.0.0.1:8000 --model smollm2 --minutes 30

Exit status 1 when a violation was found.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import random
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "support"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzzing import Violation, cases, check_answer, send  # noqa: E402


class _Stop(BaseException):
    """Ends the generation (time is up, or a violation was found); a
    BaseException so that hypothesis neither counts nor shrinks it."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-cases", type=int, default=10**9, help="stop after this many cases")
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()

    url = urlsplit(args.url)
    chosen_seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {chosen_seed}", flush=True)
    recent: collections.deque = collections.deque(maxlen=5)
    outcomes: collections.Counter = collections.Counter()
    mutations: collections.Counter = collections.Counter()
    deadline = time.monotonic() + args.minutes * 60
    violations: list[Violation] = []

    @seed(chosen_seed)
    @settings(max_examples=args.max_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases(model=args.model))
    def fuzz(case) -> None:
        if time.monotonic() > deadline:
            raise _Stop
        recent.append(case)
        try:
            status, headers, data = send(url.hostname, url.port or 80, case, timeout=args.timeout,
                                         api_key=args.api_key)
            outcome = check_answer(case, status, headers, data)
        except Violation as violation:
            violations.append(violation)
            raise _Stop from None
        outcomes[outcome] += 1
        mutations[case.mutation.split(" ")[0]] += 1
        if sum(outcomes.values()) % 100 == 0:
            print(f"{sum(outcomes.values())} cases: {dict(outcomes)}", flush=True)

    try:
        fuzz()
    except _Stop:
        pass
    sent = sum(outcomes.values())
    if violations:
        print(f"VIOLATION after {sent} good cases:\n{violations[0]}\n\ncases sent just before:")
        for earlier in list(recent)[:-1]:
            print("  ", earlier.describe())
        return 1
    print(f"{sent} cases, no violation. outcomes {dict(outcomes)}; mutations {dict(mutations)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
