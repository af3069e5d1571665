"""Packed weights written straight into their final tensors.

A packed module's GGML blocks are repacked a chunk of output rows at a time
into destinations already in the network's layout (column panels on the
CPU; (out, in) rows on CUDA and for an embedding table), and the file's
pages each chunk read are dropped from resident memory as it goes. On the
CPU a destination is the device tensor's own memory (`Uploads`), so loading
holds, beyond the weights themselves, one chunk's temporaries. Repacking a
tensor whole held it three times over: its mapped pages, its repacked
parts, and their copy in the tensor (a 0.5B model's 151k-row head: a load
peak 30 % above the settled RSS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from lockgate.plugins.tvm import runtime
from lockgate.plugins.tvm.formats import FORMATS

#: output rows repacked at a time (a multiple of every panel width and head size)
CHUNK_ROWS = 2048

#: `allocate(shape, dtype)`: a destination array for one parameter
Allocate = Callable[[tuple[int, ...], str], np.ndarray]


class Uploads:
    """Each parameter's device tensor. `allocate` gives a destination to
    write a parameter into: on the CPU a view of a new tensor's memory,
    elsewhere a host array; `tensor` turns what the loader yields into the
    tensor, copying only what was not written in place."""

    def __init__(self, device) -> None:
        self.device = device
        self.in_place = device.dlpack_device_type() == runtime.tvm_ffi.DLDeviceType.kDLCPU
        #: id of a destination view -> (the view, its tensor)
        self._made: dict[int, tuple[np.ndarray, object]] = {}

    def allocate(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        if not self.in_place:
            return np.empty(shape, dtype=dtype)
        tensor = runtime.empty(shape, dtype, self.device)
        view = np.from_dlpack(tensor)
        self._made[id(view)] = (view, tensor)
        return view

    def tensor(self, array: np.ndarray):
        """`array` as a device tensor: the one it is a view of, else a copy."""
        made = self._made.pop(id(array), None)
        return made[1] if made is not None else runtime.from_numpy(array, self.device)


def streamed_module(
    tensors,
    module: str,
    parts: list[tuple[str, int, int]],
    fmt: str,
    cols: int,
    shapes: Mapping[str, tuple[int, ...]],
    rows_layout: bool,
    allocate: Allocate,
    release: Callable[[], None] | None,
    undo_rope_permutation: Callable[[np.ndarray, int], np.ndarray],
) -> dict[str, np.ndarray] | None:
    """A packed module's parameters by name, written chunk by chunk into
    `allocate`d arrays of the shapes the network declares (`shapes`); None
    where it cannot be streamed (a tensor source without row ranges, a
    layout this does not know, a part not on panel boundaries), for the
    caller to read the tensors whole.

    :param parts: the module's GGUF tensors as (name, rows, heads whose
        Q/K rows to un-permute), stacked along the output rows.
    """
    if fmt not in FORMATS or not hasattr(tensors, "quantized_rows"):
        return None
    if any(heads and CHUNK_ROWS % (rows // heads) for _, rows, heads in parts):
        return None  # a chunk would split a head that is un-permuted
    total = sum(rows for _, rows, _ in parts)
    layouts, dtypes = {}, {}
    for part in FORMATS[fmt].parts:
        name = f"{module}.{part.name}"
        layouts[name] = _layout(shapes.get(name), total, cols // part.per, rows_layout)
        dtypes[name] = part.dtype
        if layouts[name] is None:
            return None
    widths = {layout[1] for layout in layouts.values() if layout[0] == "panels"}
    offsets = np.cumsum([0] + [rows for _, rows, _ in parts])
    if any(int(offset) % width or CHUNK_ROWS % width for offset in offsets for width in widths):
        return None  # a chunk or a part would split a panel
    out = {name: allocate(tuple(shapes[name]), dtypes[name]) for name in layouts}
    for (source, rows, heads), offset in zip(parts, offsets):
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            pieces = tensors.quantized_rows(source, rows, cols, fmt, start, stop)
            for key, piece in pieces.items():
                if heads:
                    piece = undo_rope_permutation(piece, heads * (stop - start) // rows)
                name = f"{module}.{key}"
                _write(out[name], layouts[name], piece, int(offset) + start)
            del pieces
            if release is not None:
                release()
    return out


def _layout(shape: tuple[int, ...] | None, rows: int, groups: int, rows_layout: bool):
    """How a part of `rows` output rows by `groups` input groups lies in a
    parameter of `shape`: ("rows",), ("columns",) or ("panels", width)."""
    if shape is None:
        return None
    shape = tuple(shape)
    if rows_layout:
        return ("rows",) if shape == (rows, groups) else None
    if shape == (groups, rows):
        return ("columns",)
    if len(shape) == 3 and shape[1] == groups and shape[0] * shape[2] == rows:
        return ("panels", shape[2])
    return None


def _write(dest: np.ndarray, layout: tuple, piece: np.ndarray, at: int) -> None:
    """Rows `at ..` of the output, `piece` (n, groups), into `dest`."""
    n = piece.shape[0]
    if layout[0] == "rows":
        dest[at:at + n] = piece
    elif layout[0] == "columns":
        dest[:, at:at + n] = piece.T
    else:
        width = layout[1]
        dest[at // width:(at + n) // width] = piece.reshape(n // width, width, -1).transpose(0, 2, 1)
