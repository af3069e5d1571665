"""Memory that levels off: the allocator is asked to give back what a
request with a large body freed, and /metrics shows the process's resident
memory and the prefix cache's size."""

from __future__ import annotations

import asyncio
import re

import pytest

from helpers import wait_for
from lockgate.memory import LARGE_BODY_BYTES, Trimmer, allocator_stats
from lockgate.server.keys import TRIMMER

CHAT = "/v1/chat/completions"


async def test_trims_are_rate_limited_and_close_stops_the_thread():
    trimmer = Trimmer(interval=0.5)
    if not trimmer.available:
        pytest.skip("not glibc: nothing to trim")
    trimmer.after_large_work()
    await wait_for(lambda: trimmer.trims == 1, what="the first trim")
    # asks within the interval after a trim are served by one trim after it
    for _ in range(50):
        trimmer.after_large_work()
    await wait_for(lambda: trimmer.trims == 2, what="the second trim")
    await asyncio.sleep(0.7)
    assert trimmer.trims == 2
    trimmer.close()
    assert not trimmer._thread.is_alive()
    trimmer.after_large_work()  # after close: nothing, no error
    assert trimmer.trims == 2


def test_allocator_stats_count_live_allocations_not_freed_ones():
    if allocator_stats() is None:
        pytest.skip("not glibc: no mallinfo2")
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 256 * 1024 * 1024  # far above what other threads allocate or free meanwhile
    before = allocator_stats().in_use
    block = libc.malloc(size)
    held = allocator_stats().in_use
    libc.free(block)
    after = allocator_stats().in_use
    assert held - before >= size * 0.9
    assert held - after >= size * 0.9


async def test_a_large_body_asks_for_a_trim_a_small_one_does_not(tiny_model, make_client):
    client = await make_client(tiny_model)
    trimmer = client.app[TRIMMER]
    if not trimmer.available:
        pytest.skip("not glibc: nothing to trim")
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post(CHAT, json=small)).status == 200
    assert trimmer.trims == 0
    large = {**small, "messages": [{"role": "user", "content": "x " * LARGE_BODY_BYTES}]}
    response = await client.post(CHAT, json=large)
    assert response.status == 400  # past the context, refused before it was tokenized
    await wait_for(lambda: trimmer.trims == 1, what="a trim after the large request")


async def test_metrics_show_resident_memory_and_the_prefix_cache(tiny_model, make_client):
    client = await make_client(tiny_model)
    body = {"model": "tiny", "prompt": "the cat sat on the mat " * 8, "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body)).status == 200
    await wait_for(lambda: tiny_model.engine.stats().requests_running == 0, what="an idle engine")
    text = await (await client.get("/metrics")).text()
    resident = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)[1])
    assert resident > 50 * 1024 * 1024
    if allocator_stats() is not None:
        in_use = float(re.search(r"^lockgate_allocator_in_use_bytes (\S+)$", text, re.M)[1])
        assert in_use > 1024 * 1024
        assert re.search(r"^lockgate_allocator_free_bytes \S+$", text, re.M)
    sequences = float(re.search(r'^lockgate_prefix_cache_sequences\{model="tiny"\} (\S+)$', text, re.M)[1])
    assert sequences == tiny_model.engine.stats().prefix_cache_sequences >= 1
