"""Giving memory back to the system after large transient work.

A request with a multi-megabyte body (a huge prompt, a deeply nested or
very wide JSON value, a schema of thousands of properties) makes megabytes
of short-lived allocations while it is parsed, rendered, tokenized or
compiled, on the event loop and on worker threads. glibc's allocator serves
those from its arenas, between the long-lived allocations of the requests
being served at the same moment, and when they are freed it keeps the pages:
an arena can only shrink from its top, and glibc raises its threshold for
giving large blocks their own mapping to the largest block freed so far. On
a 2-core server with ordinary streams and a client sending such requests in
a loop, resident memory grew by hundreds of MiB that glibc reported free
(`mallinfo2`) and kept.

`Trimmer` asks glibc to return those pages (`malloc_trim(0)`, which gives
back every free page of every arena, not only each arena's top) once such a
request is over: on a background thread, at most once an `interval`, so a
burst of large requests costs one trim. A trim of a fragmented gigabyte
takes milliseconds and touches nothing in use. Other allocators (musl,
jemalloc) return memory their own way: there `Trimmer` does nothing.

Measured alternatives (docs/benchmarks.md, "Memory under a mixed load"):
a fixed `M_MMAP_THRESHOLD` held memory as flat but sent every
multi-megabyte temporary of sampling (logits copies, float64 softmax rows)
through mmap and page faults at every step, a quarter of the throughput;
two arenas (`MALLOC_ARENA_MAX=2`) kept a third less and contended.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import structlog

log = structlog.get_logger("lockgate.memory")

__all__ = ["LARGE_BODY_BYTES", "AllocatorStats", "Trimmer", "allocator_stats", "trim_allocator"]

#: a request whose body is at least this large is large transient work
LARGE_BODY_BYTES = 256 * 1024


def _find_malloc_trim():
    try:
        # the symbols the process has loaded, the C library's among them
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to ask
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


#: glibc's `malloc_trim`, or None where the C library has none
_MALLOC_TRIM = _find_malloc_trim()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _find_mallinfo2():
    try:
        info = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    info.argtypes = []
    info.restype = _Mallinfo2
    return info


_MALLINFO2 = _find_mallinfo2()


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """What the C library's allocator holds, in bytes.

    `in_use` is what live allocations occupy (arena chunks in use and
    blocks mapped on their own): what a leak raises. `free_kept` is memory
    freed but kept in the arenas for reuse, resident until a trim: it saws
    with the traffic and says nothing about leaks. Python's small objects
    live in pymalloc's own mapped arenas and are in neither figure.
    """

    in_use: int
    free_kept: int


def allocator_stats() -> AllocatorStats | None:
    """The allocator's figures now (glibc's `mallinfo2`, which walks each
    arena's free lists under its lock: cheap for a scrape, not for a hot
    path); None where the C library has no `mallinfo2`."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return AllocatorStats(in_use=info.uordblks + info.hblkhd, free_kept=info.fordblks)


def trim_allocator() -> bool:
    """Have the C library give every free page of every arena back to the
    system now (glibc's `malloc_trim(0)`); False where it cannot be asked.
    Releases the GIL while it runs."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class Trimmer:
    """Returns free allocator pages to the system after large transient work.

    `after_large_work()` is cheap and thread-safe: it wakes a daemon thread,
    which trims, then waits `interval` seconds before it trims again (asks
    in between are served by one trim after the wait). `close()` stops it.
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        #: trims done (for tests and the curious)
        self.trims = 0
        self._asked = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """Whether this process's allocator can be asked to trim (glibc)."""
        return _MALLOC_TRIM is not None

    def after_large_work(self) -> None:
        if _MALLOC_TRIM is None or self._closed:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lockgate-malloc-trim", daemon=True)
                self._thread.start()
        self._asked.set()

    def close(self) -> None:
        self._closed = True
        self._asked.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            if self._closed:
                return
            self._asked.clear()
            # ctypes lets go of the GIL for the call: requests go on meanwhile
            started = time.perf_counter()
            trim_allocator()
            self.trims += 1
            log.debug("allocator trimmed", duration_ms=round((time.perf_counter() - started) * 1000, 2))
            time.sleep(self.interval)
