"""What it costs to keep a client's grammar compile from crashing the server.

llguidance recurses over a JSON schema on the native stack; an overflow is a
segmentation fault of the whole process. Three ways to run the compile,
measured side by side on the default model's tokenizer:

* inline: on the calling thread (what lockgate did before; unsafe);
* large-stack thread: `lockgate.native.run_with_large_stack` (what it does);
* checked in a process: a warm worker process (tokenizer loaded once) compiles
  the schema first, and only if it survives is the schema compiled again
  in-process, since the engine needs the matcher in its own memory.

    python benchmarks/grammar_isolation.py [--repeat 20]

Prints the best and median time per compile for a few schemas, and the
hand-off overhead of each way against inline.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import gguf

from lockgate.plugin_api import grammars
from lockgate.native import run_with_large_stack
from lockgate.plugins.models import locate_smollm2
from lockgate.models.tokenizer import load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {
    "json_object": {"type": "object"},
    "person": PERSON,
    "family ($defs)": {
        "$defs": {"Person": PERSON},
        "type": "object",
        "properties": {"members": {"type": "array", "items": {"$ref": "#/$defs/Person"}}},
        "required": ["members"],
    },
    "200 properties": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(200)},
    },
}

_worker_tokenizer = None


def _load_llg_tokenizer():
    return grammars._llg_tokenizer(load_tokenizer(gguf.GGUFReader(locate_smollm2())), None)


def _worker_init() -> None:
    global _worker_tokenizer
    _worker_tokenizer = _load_llg_tokenizer()


def _worker_check(schema) -> bool:
    grammars._compile(schema, False, _worker_tokenizer)
    return True


def _timed(fn, repeat: int) -> list[float]:
    fn()  # warm
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    llg = _load_llg_tokenizer()
    pool = multiprocessing.get_context("forkserver").Pool(1, initializer=_worker_init)
    pool.apply(_worker_check, ({"type": "object"},))  # the worker is warm from here on

    print(f"{'schema':16} {'way':22} {'best ms':>9} {'median ms':>10} {'overhead ms':>12}")
    for name, schema in SCHEMAS.items():
        ways = {
            "inline": lambda: grammars._compile(schema, False, llg),
            "large-stack thread": lambda: run_with_large_stack(
                lambda: grammars._compile(schema, False, llg)
            ),
            "checked in a process": lambda: (
                pool.apply(_worker_check, (schema,)) and grammars._compile(schema, False, llg)
            ),
        }
        baseline = None
        for way, fn in ways.items():
            runs = _timed(fn, args.repeat)
            median = statistics.median(runs)
            baseline = median if baseline is None else baseline
            print(
                f"{name:16} {way:22} {min(runs) * 1e3:9.2f} {median * 1e3:10.2f} "
                f"{(median - baseline) * 1e3:12.2f}"
            )
    pool.close()
    pool.join()


if __name__ == "__main__":
    main()
