"""Where things are, for tests wherever they sit under tests/."""

from __future__ import annotations

import pathlib

#: the repository
ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: the helpers and test doubles (on sys.path: tests/conftest.py puts it there)
SUPPORT = TESTS / "support"
#: recorded goldens, tasks and the scripts that record them
DATA = TESTS / "data"
BENCHMARKS = ROOT / "benchmarks"
