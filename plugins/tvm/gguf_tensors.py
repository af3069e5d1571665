"""A GGUF file's tensors: memory-mapped, named, read as float arrays or as
the packed codes and scales of their GGML blocks.

`GGUFTensors` is the tensor source the weight loader (`weights.py`) reads;
`lockgate.models.hf.HFTensors` offers the same interface for a Hugging Face
directory. Blocks of the packed types (`formats.FORMATS`: Q4_0 to Q8_0 and
the K-quants) are repacked bit-exactly into the arrays the matmuls
dequantize as they multiply; other GGML types are dequantized here.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.plugins.tvm.formats import FORMAT_OF_TYPE as PACKED_FORMAT_OF_TYPE
from lockgate.plugins.tvm.formats import pack_blocks, unpack_values

PLAIN_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}

#: how a linear weight of each GGML type is stored: "f32", "f16" or a packed
#: format of `formats.FORMATS`; other types (BF16, the IQ types, …) are
#: widened to float16
FORMAT_OF_TYPE = {
    gguf.GGMLQuantizationType.F32: "f32",
    gguf.GGMLQuantizationType.F16: "f16",
    **PACKED_FORMAT_OF_TYPE,
}

#: the GGML type of each format
TYPE_OF_FORMAT = {fmt: qtype for qtype, fmt in FORMAT_OF_TYPE.items()}

#: rows dequantized at a time when a packed tensor is read whole
_ROWS_PER_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """One tensor of a GGUF file: ggml shape (innermost first), type, bytes."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


def read_tensor_index(source: str | os.PathLike | GGUFMetadata) -> dict[str, RawTensor]:
    """The tensors of a GGUF file, memory-mapped.

    :param source: the file's path, or its `GGUFMetadata` when the header
        has already been read (then it is not parsed again).

    The table comes from `lockgate.models.gguf_metadata` (fast, unlike
    `gguf.GGUFReader`, which turns the 49k-entry vocabulary into numpy
    objects); the data is mapped, not read.
    """
    meta = source if isinstance(source, GGUFMetadata) else GGUFMetadata(source)
    path = meta.path
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for info in meta.tensors:
        try:
            qtype = gguf.GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {info.name} has unknown ggml type {info.ggml_type}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(info.shape) // block * block_bytes
        start = meta.data_offset + info.offset
        if start + nbytes > data.size:
            raise ModelLoadError(f"malformed GGUF file {path}: tensor {info.name} runs past the end")
        raw = data[start : start + nbytes]
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            raw = raw.view(np.float16)
        tensors[info.name] = RawTensor(info.name, info.shape, qtype, raw)
    return tensors


class GGUFTensors:
    """Named access to the tensors of one GGUF file: float32 values, or the
    quantized codes and scales of a block-quantized matrix.

    :param source: the file's path or its `GGUFMetadata` (`read_tensor_index`).
    """

    def __init__(self, source: str | os.PathLike | GGUFMetadata) -> None:
        self._tensors = read_tensor_index(source)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType | None:
        """The GGML type of a tensor, None when the file lacks it."""
        tensor = self._tensors.get(name)
        return None if tensor is None else gguf.GGMLQuantizationType(tensor.tensor_type)

    def matrix(self, name: str, rows: int, cols: int, dtype=np.float32) -> np.ndarray:
        """The tensor as a (rows, cols) = (out, in) array of `dtype`
        (float32, or float16 for a weight stored as f16: an F16 tensor is
        then the file's own bytes, never widened on the way)."""
        return self._read(name, (rows, cols), dtype)

    def vector(self, name: str, size: int) -> np.ndarray:
        return self._read(name, (size,))

    def quantized(self, name: str, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
        """A block-quantized (out, in) matrix as the parts of packed format
        `fmt` (`formats.pack_blocks`): the file's own codes and scales, so
        the values they stand for are bit-exactly those of llama.cpp's
        dequantization."""
        return self.quantized_rows(name, rows, cols, fmt, 0, rows)

    def quantized_rows(self, name: str, rows: int, cols: int, fmt: str, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows `start` to `stop` of `quantized(name, rows, cols, fmt)`,
        read from the file's pages for those rows alone."""
        tensor = self._checked(name, (rows, cols))
        if self.tensor_type(name) != TYPE_OF_FORMAT[fmt]:
            raise ModelLoadError(f"tensor {name!r} is {self.tensor_type(name).name}, not {fmt}")
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)[start:stop]
        return pack_blocks(raw, stop - start, cols, fmt)

    def _checked(self, name: str, shape: tuple[int, ...]):
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        ggml_shape = tuple(int(d) for d in tensor.shape)
        if ggml_shape != tuple(reversed(shape)):
            raise ModelLoadError(
                f"tensor {name!r} has shape {list(ggml_shape)} (ggml order), "
                f"expected {list(reversed(shape))}"
            )
        return tensor

    def release_pages(self) -> None:
        """Drop the file's pages read so far from this process's resident
        memory (they stay in the page cache): reading a whole model through
        the map would otherwise hold the file's size in RSS until the end."""
        # every tensor is a view of the one map of the file
        first = next(iter(self._tensors.values()), None)
        mapping = getattr(first.data, "_mmap", None) if first is not None else None
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def _read(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        tensor = self._checked(name, shape)
        qtype = tensor.tensor_type
        if dtype == np.float16 and qtype == gguf.GGMLQuantizationType.F16:
            return np.asarray(tensor.data).reshape(shape)
        if qtype in PACKED_FORMAT_OF_TYPE and len(shape) == 2:
            return self._unpacked(tensor, shape, PACKED_FORMAT_OF_TYPE[qtype], dtype)
        try:
            if qtype in PLAIN_TYPES:
                values = np.asarray(tensor.data, dtype=np.float32)
            else:
                values = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"tensor {name!r} has GGML type {qtype.name}, which cannot be dequantized"
            ) from exc
        return np.asarray(values, dtype=np.float32).reshape(shape).astype(dtype, copy=False)


    @staticmethod
    def _unpacked(tensor: RawTensor, shape: tuple[int, int], fmt: str, dtype) -> np.ndarray:
        """A packed matrix's values, dequantized a chunk of rows at a time
        (`formats.unpack_values`, vectorized, unlike gguf's own)."""
        rows, cols = shape
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
        out = np.empty(shape, dtype=dtype)
        for start in range(0, rows, _ROWS_PER_CHUNK):
            chunk = raw[start : start + _ROWS_PER_CHUNK]
            parts = pack_blocks(chunk, chunk.shape[0], cols, fmt)
            out[start : start + chunk.shape[0]] = unpack_values(parts, fmt)
        return out
