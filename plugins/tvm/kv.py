"""The executor's KV cache at run time, one interface over two caches:
lockgate's own on the CPU (`CPUCache`: `page_pool.PagePool` over pools the
compiled functions read, see `paged_attention`) and TVM's `PagedKVCache`
on CUDA (`TVMCache`).

Both hold sequences by id, fork, truncate (to `length` of the `held`
tokens) and remove them, count free pages, and run one forward pass (`forward`): given
the step's sequences and how many tokens each appends, they call the
compiled function with what it takes as its `kv_cache` argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lockgate.plugins.tvm import runtime
from lockgate.plugins.tvm.page_pool import PAGE_SIZE, PagePool


def kv_cache_bytes(config, pages: int, page_size: int) -> int:
    """Bytes of float16 keys and values for `pages` pages of every layer
    (what either cache allocates for them)."""
    return 2 * 2 * config.num_layers * pages * config.num_kv_heads * config.head_dim * page_size


class CPUCache:
    """Pools of `pages` pages for `config`'s layers, and their pages."""

    page_size = PAGE_SIZE

    def __init__(self, config, pages: int, device) -> None:
        shape = (config.num_layers, pages, config.num_kv_heads)
        self._k = runtime.empty((*shape, config.head_dim, PAGE_SIZE), "float16", device)
        self._v = runtime.empty((*shape, PAGE_SIZE, config.head_dim), "float16", device)
        self._k_np, self._v_np = np.from_dlpack(self._k), np.from_dlpack(self._v)
        self._pool = PagePool(pages, self._copy_page)
        self._device = device
        self.total_pages = pages

    def _copy_page(self, src: int, dst: int) -> None:
        self._k_np[:, dst] = self._k_np[:, src]
        self._v_np[:, dst] = self._v_np[:, src]

    def add(self, seq_id: int) -> None:
        self._pool.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._pool.remove(seq_id)

    def fork(self, parent_id: int, child_id: int, position: int) -> None:
        self._pool.fork(parent_id, child_id, position)

    def truncate(self, seq_id: int, length: int, held: int) -> None:
        self._pool.truncate(seq_id, length)

    def free_pages(self) -> int:
        return self._pool.free_pages()

    def forward(self, seq_ids: Sequence[int], lengths: Sequence[int], run: Callable, *, prefill: bool):
        """`run(kv)` with the pools and the step's page tables."""
        step = self._pool.step(seq_ids, lengths)
        put = self._put
        kv = [self._k, self._v, put(step.positions), put(step.slots), put(step.page_indptr), put(step.page_values)]
        if prefill:
            kv.append(put(step.q_indptr))
        return run(kv)

    def _put(self, array: np.ndarray):
        return runtime.from_numpy(array, self._device)


class TVMCache:
    """TVM's paged KV cache, created by the compiled module's
    `create_tir_paged_kv_cache`, for `max_num_seqs` sequences and `pages`
    pages, and `pad` more of each for the executor's padding sequences
    (held during a step only, so kept out of what `free_pages` reports)."""

    def __init__(self, vm, page_size: int, max_num_seqs: int, pages: int, chunk: int, pad: int) -> None:
        f = runtime.get_global_func
        self._add = f("vm.builtin.kv_state_add_sequence")
        self._remove = f("vm.builtin.kv_state_remove_sequence")
        self._fork = f("vm.builtin.kv_state_fork_sequence")
        self._begin = f("vm.builtin.kv_state_begin_forward")
        self._end = f("vm.builtin.kv_state_end_forward")
        self._available = f("vm.builtin.attention_kv_cache_get_num_available_pages")
        self._popn = f("vm.builtin.kv_state_popn")
        self._pad = pad
        self.page_size = page_size
        self._kv = vm["create_tir_paged_kv_cache"](
            runtime.Shape([max_num_seqs + pad]),
            runtime.Shape([(pages + pad) * page_size]),
            runtime.Shape([chunk]),
            runtime.Shape([page_size]),
        )
        self.total_pages = int(self._available(self._kv)) - pad

    def add(self, seq_id: int) -> None:
        self._add(self._kv, seq_id)

    def remove(self, seq_id: int) -> None:
        self._remove(self._kv, seq_id)

    def fork(self, parent_id: int, child_id: int, position: int) -> None:
        self._fork(self._kv, parent_id, child_id, position)

    def truncate(self, seq_id: int, length: int, held: int) -> None:
        # a pop into a block the sequence shares forks it anew, copying the page it is cut inside
        if length % self.page_size and self.free_pages() < 1:
            raise ValueError(f"cannot truncate sequence {seq_id}: no free KV page for the page at {length}")
        self._popn(self._kv, seq_id, held - length)

    def free_pages(self) -> int:
        return int(self._available(self._kv)) - self._pad

    def forward(self, seq_ids: Sequence[int], lengths: Sequence[int], run: Callable, *, prefill: bool):
        """`run(kv)` between the cache's begin and end of a forward pass."""
        self._begin(self._kv, runtime.Shape(list(seq_ids)), runtime.Shape(list(lengths)))
        try:
            return run(self._kv)
        finally:
            self._end(self._kv)
