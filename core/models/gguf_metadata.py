"""Reading a GGUF file's metadata and tensor table quickly.

`gguf.GGUFReader` turns every metadata array into numpy objects field by
field, which takes about three seconds for SmolLM2's 49k-token vocabulary and
merge list: most of a warm start. This reader parses the key/value section
straight into Python values and lists the tensor names, in a fraction of
that. It offers the part of `GGUFReader`'s interface lockgate uses
(`fields[key].contents()`, `fields[key].data`, `tensors[i].name`), so either
can be passed where a reader is expected.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

from lockgate.errors import ModelLoadError

# GGUF value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALARS = {
    _UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
    _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d",
}


@dataclasses.dataclass(frozen=True)
class MetadataField:
    """One metadata value, already converted to Python."""

    value: Any

    def contents(self) -> Any:
        return self.value

    @property
    def data(self) -> Any:
        """The items of an array value (GGUFReader's name for them)."""
        return self.value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ggml shape (innermost first), ggml type number,
    and its offset from `GGUFMetadata.data_offset`."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class GGUFMetadata:
    """The metadata and tensor table of a GGUF file (no tensor data is read).

    :ivar data_offset: where the tensor data section starts in the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.fields, self.tensors, self.data_offset = _parse(buf)
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read {self.path} as GGUF: {exc}") from exc


def _parse(buf) -> tuple[dict[str, MetadataField], list[TensorInfo], int]:
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    pos = 24
    unpack_from = struct.unpack_from

    def string() -> str:
        nonlocal pos
        (length,) = unpack_from("<Q", buf, pos)
        start = pos + 8
        pos = start + length
        return bytes(buf[start:pos]).decode("utf-8")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, count = unpack_from("<IQ", buf, pos)
            pos += 12
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                items = list(unpack_from(f"<{count}{fmt}", buf, pos))
                pos += struct.calcsize(fmt) * count
                return items
            return [value(item_kind) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {kind}")
        (result,) = unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return result

    fields: dict[str, MetadataField] = {}
    for _ in range(kv_count):
        key = string()
        (kind,) = unpack_from("<I", buf, pos)
        pos += 4
        fields[key] = MetadataField(value(kind))
    tensors = []
    for _ in range(tensor_count):
        name = string()
        (n_dims,) = unpack_from("<I", buf, pos)
        shape = unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
    field = fields.get("general.alignment")
    alignment = int(field.value) if field is not None else 32
    return fields, tensors, -(-pos // alignment) * alignment
