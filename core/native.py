"""Threads with a large stack, for native code that recurses over client input.

A stack overflow in native code is not an exception: it is a segmentation
fault that takes the whole process, every in-flight request with it. Some
native parsers recurse once per level of what they parse (llguidance follows a
JSON schema's `$ref` chain that way, several KiB of stack per level), so a
small request can need more stack than a thread has. Limits checked before
the call (`lockgate.engine.structured` bounds schema depth and `$ref` chains) are the
first defence; running the call on a thread whose stack is far larger than
those limits need is the second, for the shapes the limits do not foresee.

Why threads and not a separate process: a process would also survive native
faults other than stack overflow, but the compiled object (an llguidance
matcher) has to live in the engine's process, so a process could only
*check* a grammar that is then compiled again here, paying the compile twice
plus the IPC, and keep a worker per core warm with its own copy of the
tokenizer. A thread costs a hand-off (tens of microseconds; the three ways
are measured side by side by `benchmarks/grammar_isolation.py`) and a
reservation of address space that is only backed by memory where it is
touched.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["LARGE_STACK_BYTES", "run_with_large_stack"]

T = TypeVar("T")

#: stack of each worker thread: about 100 times what the schema limits let
#: llguidance use, and only address space until it is touched
LARGE_STACK_BYTES = 256 * 1024 * 1024
#: workers, so that concurrent requests do not wait on each other's compile
_WORKERS = 4

_jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
_started = False
_start_lock = threading.Lock()


def run_with_large_stack(fn: Callable[[], T]) -> T:
    """Call `fn()` on a worker thread with a `LARGE_STACK_BYTES` stack and
    return its result or raise its exception, in the calling thread.

    Blocks the caller until `fn` is done; meant for the request pipeline's
    worker threads, never for the event loop.
    """
    _ensure_workers()
    future: Future = Future()
    _jobs.put((fn, future))
    return future.result()


def _ensure_workers() -> None:
    global _started
    if _started:
        return
    with _start_lock:
        if _started:
            return
        # threading.stack_size is process-wide and applies to threads started
        # after it is set: set it, start the workers, put it back at once.
        previous = threading.stack_size(LARGE_STACK_BYTES)
        try:
            for i in range(_WORKERS):
                threading.Thread(
                    target=_work, name=f"lockgate-large-stack-{i}", daemon=True
                ).start()
        finally:
            threading.stack_size(previous)
        _started = True


def _work() -> None:
    while True:
        fn, future = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn()
        except BaseException as exc:  # handed to the caller, which re-raises it
            future.set_exception(exc)
        else:
            future.set_result(result)
        del fn, future
