"""A GGUF file's tensors: memory-mapped, named, read as float arrays or as
the packed codes and scales of their GGML blocks.

`GGUFTensors` is the tensor source the weight loader (`weights.py`) reads;
`lockgate.models.hf.HFTensors` offers the same interface for a Hugging Face
directory. Q4_0, Q4_1 and Q8_0 blocks are repacked bit-exactly into codes
plus per-32 scales (and minimums), which the matmuls dequantize as they
multiply; other GGML types are dequantized here.
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

PLAIN_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def _dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    # block: f16 scale, 32 x int8
    blocks = raw.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 2:].view(np.int8).astype(np.float32)
    return codes * scale


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # element j is the low nibble of byte j, element j + 16 the high nibble
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    # block: f16 scale, 16 bytes of 4-bit codes; value = d * (q - 8)
    blocks = raw.reshape(-1, 18)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (_nibbles(blocks[:, 2:]) - 8.0) * scale


def _dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    # block: f16 scale, f16 minimum, 16 bytes of 4-bit codes; value = d * q + m
    blocks = raw.reshape(-1, 20)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 4:]) * scale + minimum


#: whole-tensor numpy dequantizers; gguf's own work a few rows at a time and
#: take seconds on a 135M-parameter model
_FAST_DEQUANTIZE = {
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    gguf.GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


#: how a linear weight of each GGML type is stored on the CPU
FORMAT_OF_TYPE = {
    gguf.GGMLQuantizationType.F32: "f32",
    gguf.GGMLQuantizationType.F16: "f16",
    gguf.GGMLQuantizationType.Q8_0: "q8_0",
    gguf.GGMLQuantizationType.Q4_0: "q4_0",
    gguf.GGMLQuantizationType.Q4_1: "q4_1",
}

#: the GGML type of each packed format
TYPE_OF_FORMAT = {fmt: qtype for qtype, fmt in FORMAT_OF_TYPE.items()}

#: bytes of one 32-element block, and where its codes start, per format
_BLOCK_LAYOUT = {"q8_0": (34, 2), "q4_0": (18, 2), "q4_1": (20, 4)}

#: the formats kept quantized
QUANTIZED_FORMATS = tuple(_BLOCK_LAYOUT)


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


def codes_of_blocks(blocks: np.ndarray, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
    """GGML blocks of an (out, in) matrix, as uint8 bytes, repacked into
    `codes`, (rows, cols / 8) uint32 for the 4-bit formats (code of column
    k in bits 4·(k % 8) of word k // 8) or (rows, cols) int8 for Q8_0, and
    float32 `scales` (rows, cols / 32), plus `mins` for Q4_1."""
    block_bytes, codes_at = _BLOCK_LAYOUT[fmt]
    blocks = blocks.reshape(rows, cols // 32, block_bytes)
    out = {"scales": blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)}
    if fmt == "q4_1":
        out["mins"] = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., codes_at:]
    if fmt == "q8_0":
        out["codes"] = qs.reshape(rows, cols).view(np.int8)
        return out
    # element j of a block is the low nibble of byte j, element j + 16
    # the high nibble
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols // 8, 8)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    out["codes"] = np.bitwise_or.reduce(nibbles.astype(np.uint32) << shifts, axis=-1)
    return out


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
        """A block-quantized (out, in) matrix as its codes and scales
        (`codes_of_blocks`): the file's own codes, so the values they stand
        for are bit-exactly those of llama.cpp's dequantization."""
        tensor = self._checked(name, (rows, cols))
        if self.tensor_type(name) != TYPE_OF_FORMAT[fmt]:
            raise ModelLoadError(f"tensor {name!r} is {self.tensor_type(name).name}, not {fmt}")
        return codes_of_blocks(np.asarray(tensor.data, dtype=np.uint8), rows, cols, fmt)

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
        try:
            if qtype in PLAIN_TYPES:
                values = np.asarray(tensor.data, dtype=np.float32)
            elif qtype in _FAST_DEQUANTIZE:
                values = _FAST_DEQUANTIZE[qtype](np.asarray(tensor.data, dtype=np.uint8))
            else:
                values = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"tensor {name!r} has GGML type {qtype.name}, which cannot be dequantized"
            ) from exc
        return np.asarray(values, dtype=np.float32).reshape(shape).astype(dtype, copy=False)

