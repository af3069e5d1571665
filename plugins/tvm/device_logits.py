"""Logits left on the device: the TVM executor's `DeviceLogits`, which its
own sampler reads where they are, and the views that keep a reshaped
device tensor's base alive."""

from __future__ import annotations

import numpy as np

from lockgate.plugins.tvm import runtime


class DeviceLogits:
    """Logits a forward pass left on the device, and which of its rows they
    are: `index[i]` is the tensor row of logits row `i` (rows may repeat:
    the choices of one request share its prompt's row; the padding rows of
    a CUDA-graph bucket are in no index).

    It answers what the engine asks of logits: `len()`, `.shape` and
    `logits[row_indices]` (a list, array or slice), which composes the index
    and copies nothing. `numpy()` (or `np.asarray`) copies the rows to the
    host, and `logits[i]` row `i`, for tests and other readers. Valid until
    the executor's next `prefill` or `decode`, which may reuse the memory.
    """

    __slots__ = ("base", "tensor", "index")

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, base, tensor, index: np.ndarray) -> None:
        #: the forward pass's output, kept alive for `tensor`, a view of it
        self.base = base
        #: `[held, vocab]` on the device
        self.tensor = tensor
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), int(self.tensor.shape[1]))

    def __getitem__(self, rows):
        if isinstance(rows, (int, np.integer)):
            # one row, on the host (numpy's `logits[i]`)
            row = int(self.index[rows])
            view = runtime.create_view(self.tensor, (row + 1, self.shape[1]))
            return np.asarray(runtime.to_numpy(view)[row], dtype=np.float32)
        if isinstance(rows, tuple):
            raise TypeError("DeviceLogits takes row indices (an int, a list or a slice); use numpy() for more")
        index = self.index[rows if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)]
        if index.ndim != 1:
            raise TypeError("DeviceLogits takes a flat list of row indices")
        return DeviceLogits(self.base, self.tensor, index)

    def numpy(self) -> np.ndarray:
        """The rows on the host, `(len(self), vocab)` float32."""
        return np.asarray(runtime.to_numpy(self.tensor), dtype=np.float32)[self.index]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeviceLogits(shape={self.shape}, held={int(self.tensor.shape[0])}, device={self.tensor.device})"


class View:
    """A device tensor and its reshaped view, kept together so the base
    outlives the view."""

    def __init__(self, tensor) -> None:
        self.base = tensor
        self.tensor = tensor

    def view_as(self, shape: tuple[int, ...]) -> "View":
        self.tensor = runtime.create_view(self.base, shape)
        return self
