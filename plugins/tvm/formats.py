"""The packed weight formats: how each GGML block type is stored for the
kernels and dequantized inside them.

A `WeightFormat` names the arrays a linear weight of its type keeps (its
`Part`s), how GGML blocks are repacked into them at load (`pack`, in
`packing.py`), and the
value of element k of an output column as a TIR expression (`value`), which
the CPU matmul (`layers.Linear`) and the CUDA one (`layers.GPULinear`) both
inline into their reductions, so a weight is never stored widened.

Every part is indexed along the input axis by `k // per`, and the bits
inside a word are ordered so that the CPU's 8-bit kernels (`int8_matmul.py`)
find, in byte b of an output's word, the codes of four consecutive inputs
(b = k % 4) side by side with their neighbours' words, 64 bytes for 16
outputs, the shape of one VNNI dot product:

* `codes`: 4-bit codes, eight to a uint32 word: code k in the low nibble of
  byte k % 4 of word k // 8 when k % 8 < 4, in its high nibble otherwise;
  or Q8_0's int8 codes, four to an int32 word (byte k % 4 of word k // 4);
* `high`: the codes' extra high bits, in uint32 words: Q5's fifth bit (per
  32 inputs, bit 2·(k % 32 // 8) + k % 8 // 4 of byte k % 4) or Q6_K's two
  top bits (per 16 inputs, bits 2·(2·(k % 16 // 8) + k % 8 // 4) and up of
  byte k % 4);
* `scales`, `mins`: float16 per block of 32, as the file has them;
* `sub_scales`, `sub_mins`: a K-quant's 6-bit (Q4_K, Q5_K) or int8 (Q6_K)
  scales per sub-block of 32 (16 for Q6_K), one byte each;
* `super_scales`, `super_mins`: a K-quant's float16 `d` and `dmin` per
  super-block of 256.

The values are bit-exactly GGML's float32 dequantization: a K-quant's
sub-block scale d·sc is an 11-bit by 6-bit (8-bit for Q6_K) product, exact
in float32, so (d·sc)·q − dmin·m rounds once, wherever it is computed. The
stored bytes are the file's, give or take a byte per 32 inputs for the
unpacked 6-bit sub-scales of Q4_K/Q5_K (4.625 and 5.625 bits a weight
against 4.5 and 5.5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import numpy as np

from lockgate.plugins.tvm import packing

Q = gguf.GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class Part:
    """One stored array of a packed weight: (out, in / per) of `dtype` in
    (out, in) order (the CPU's column panels transpose it)."""

    name: str
    dtype: str
    per: int


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """A GGML block type as the kernels keep and read it."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    #: inputs per GGML block (32, or 256 for the K-quants)
    block: int
    parts: tuple[Part, ...]
    #: (load, k) -> the float32 value of input k, where load(part name)
    #: reads that part at k // part.per for the output column at hand
    value: Callable
    #: (blocks, rows, cols) -> {part name: (rows, cols / per) array}, from
    #: the file's bytes viewed as (rows, cols / block, block bytes) uint8
    pack: Callable[[np.ndarray, int, int], dict[str, np.ndarray]]

    @property
    def bits_per_weight(self) -> float:
        return sum(np.dtype(p.dtype).itemsize * 8 / p.per for p in self.parts)


# -- the values, as TIR ----------------------------------------------------


def _f32(x):
    return x.astype("float32")


def _const(like, value, dtype: str):
    """A constant for an expression like `like`: TIR's, or numpy's when the
    values are computed in numpy (`unpack_values`), so loading weights
    needs no TVM."""
    if isinstance(like, _NumpyExpr):
        return np.array(value, dtype=dtype)
    from tvm import tirx

    return tirx.const(value, dtype)


def _byte_of(k):
    """The bit where input k's byte starts in its word: byte k % 4."""
    return k % 4 * 8


def _nibble(load, k):
    shift = _byte_of(k) + k % 8 // 4 * 4
    return (load("codes") >> shift.astype("uint32")) & _const(k, 15, "uint32")


def _five_bits(load, k):
    shift = _byte_of(k) + k % 32 // 8 * 2 + k % 8 // 4
    high = (load("high") >> shift.astype("uint32")) & _const(k, 1, "uint32")
    return _nibble(load, k) | (high << _const(k, 4, "uint32"))


def _six_bits(load, k):
    shift = _byte_of(k) + (k % 16 // 8 * 2 + k % 8 // 4) * 2
    high = (load("high") >> shift.astype("uint32")) & _const(k, 3, "uint32")
    return _nibble(load, k) | (high << _const(k, 4, "uint32"))


def _signed_byte(load, k):
    """Q8_0's code k: byte k % 4 of an int32 word, as int8."""
    return (load("codes") >> _byte_of(k).astype("int32")).astype("int8")


def _centred(code, centre: int):
    return _f32(code) - _const(code, float(centre), "float32")


def _sub_scale(load):
    return _f32(load("super_scales")) * _f32(load("sub_scales"))


def _sub_min(load):
    return _f32(load("super_mins")) * _f32(load("sub_mins"))


def _value_q8_0(load, k):
    return _f32(_signed_byte(load, k)) * _f32(load("scales"))


def _value_q4_0(load, k):
    return _centred(_nibble(load, k), 8) * _f32(load("scales"))


def _value_q4_1(load, k):
    return _f32(_nibble(load, k)) * _f32(load("scales")) + _f32(load("mins"))


def _value_q5_0(load, k):
    return _centred(_five_bits(load, k), 16) * _f32(load("scales"))


def _value_q5_1(load, k):
    return _f32(_five_bits(load, k)) * _f32(load("scales")) + _f32(load("mins"))


def _value_q4_k(load, k):
    return _sub_scale(load) * _f32(_nibble(load, k)) - _sub_min(load)


def _value_q5_k(load, k):
    return _sub_scale(load) * _f32(_five_bits(load, k)) - _sub_min(load)


def _value_q6_k(load, k):
    return _sub_scale(load) * _centred(_six_bits(load, k), 32)


_SCALE = Part("scales", "float16", 32)
_MIN = Part("mins", "float16", 32)
_NIBBLES = Part("codes", "uint32", 8)
_K_PARTS = (
    Part("sub_scales", "uint8", 32),
    Part("sub_mins", "uint8", 32),
    Part("super_scales", "float16", 256),
    Part("super_mins", "float16", 256),
)

#: the packed formats, by name
FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("q8_0", Q.Q8_0, 32, (Part("codes", "int32", 4), _SCALE), _value_q8_0, packing.pack_q8_0),
        WeightFormat("q4_0", Q.Q4_0, 32, (_NIBBLES, _SCALE), _value_q4_0, packing.pack_q4_0),
        WeightFormat("q4_1", Q.Q4_1, 32, (_NIBBLES, _SCALE, _MIN), _value_q4_1, packing.pack_q4_1),
        WeightFormat(
            "q5_0", Q.Q5_0, 32, (_NIBBLES, Part("high", "uint32", 32), _SCALE), _value_q5_0, packing.pack_q5_0
        ),
        WeightFormat(
            "q5_1",
            Q.Q5_1,
            32,
            (_NIBBLES, Part("high", "uint32", 32), _SCALE, _MIN),
            _value_q5_1,
            packing.pack_q5_1,
        ),
        WeightFormat("q4_k", Q.Q4_K, 256, (_NIBBLES, *_K_PARTS), _value_q4_k, packing.pack_q4_k),
        WeightFormat(
            "q5_k", Q.Q5_K, 256, (_NIBBLES, Part("high", "uint32", 32), *_K_PARTS), _value_q5_k, packing.pack_q5_k
        ),
        WeightFormat(
            "q6_k",
            Q.Q6_K,
            256,
            (
                _NIBBLES,
                Part("high", "uint32", 16),
                Part("sub_scales", "int8", 16),
                Part("super_scales", "float16", 256),
            ),
            _value_q6_k,
            packing.pack_q6_k,
        ),
    )
}

#: the entry of a model's formats (`weights.linear_formats`, beside each
#: module's format) that chooses how the CPU multiplies packed weights:
#: "int8" (activations rounded to 8 bits, `int8_matmul`; the default where
#: the CPU has AVX2) or "float32" (each weight dequantized; exact)
CPU_ACTIVATIONS = "cpu_activations"

#: the format a GGML type runs in, for the packed types
FORMAT_OF_TYPE = {f.ggml_type: f.name for f in FORMATS.values()}


#: rows repacked at a time: the unpacking's temporaries (codes widened to
#: uint32 words, shifted) are several times the packed size, so a whole
#: 128k-row head at once peaked at 3.6 GB for a 1B model of 0.9 GB
_PACK_ROWS = 2048


def pack_blocks(raw: np.ndarray, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
    """An (out, in) matrix's GGML blocks (uint8 bytes) as `fmt`'s parts,
    repacked `_PACK_ROWS` rows at a time into the final arrays."""
    spec = FORMATS[fmt]
    _, block_bytes = gguf.GGML_QUANT_SIZES[spec.ggml_type]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // spec.block, block_bytes)
    if rows <= _PACK_ROWS:
        return spec.pack(blocks, rows, cols)
    out = {
        part.name: np.empty((rows, cols // part.per), dtype=part.dtype) for part in spec.parts
    }
    for start in range(0, rows, _PACK_ROWS):
        chunk = blocks[start : start + _PACK_ROWS]
        for name, array in spec.pack(chunk, chunk.shape[0], cols).items():
            out[name][start : start + chunk.shape[0]] = array
    return out


def unpack_values(parts: dict[str, np.ndarray], fmt: str) -> np.ndarray:
    """The float32 values packed parts stand for, computed in numpy as the
    kernels compute them (for tests and for reading a packed tensor whole)."""
    spec = FORMATS[fmt]
    rows = parts["codes"].shape[0]
    cols = parts["codes"].shape[1] * next(p.per for p in spec.parts if p.name == "codes")
    k = np.arange(cols)

    def load(name):
        per = next(p.per for p in spec.parts if p.name == name)
        return _NumpyExpr(parts[name][:, k // per])

    return np.asarray(spec.value(load, _NumpyExpr(k)).array, dtype=np.float32).reshape(rows, cols)


class _NumpyExpr:
    """Just enough of TIR's expression interface to evaluate a format's
    `value` over numpy arrays, with TIR's dtypes (uint32 shifts, float32
    arithmetic)."""

    def __init__(self, array) -> None:
        self.array = np.asarray(array)

    @staticmethod
    def _of(other):
        if isinstance(other, _NumpyExpr):
            return other.array
        return other

    def astype(self, dtype):
        return _NumpyExpr(self.array.astype(dtype))

    def _op(self, other, fn):
        return _NumpyExpr(fn(self.array, self._of(other)))

    def __rshift__(self, o):
        return self._op(o, np.right_shift)

    def __lshift__(self, o):
        return self._op(o, np.left_shift)

    def __and__(self, o):
        return self._op(o, np.bitwise_and)

    def __or__(self, o):
        return self._op(o, np.bitwise_or)

    def __mod__(self, o):
        return self._op(o, np.mod)

    def __floordiv__(self, o):
        return self._op(o, np.floor_divide)

    def __rsub__(self, o):
        return _NumpyExpr(np.subtract(self._of(o), self.array))

    def __mul__(self, o):
        return self._op(o, np.multiply)

    def __add__(self, o):
        return self._op(o, np.add)

    def __sub__(self, o):
        return self._op(o, np.subtract)


def split_groups(fmt: str, out_sizes: tuple[int, ...]) -> list[tuple[int, str]]:
    """A fused module's per-tensor formats ("q4_k,q4_k,q6_k", one per
    tensor, as `weights.linear_formats` writes them) as (output size,
    format) runs of equal format."""
    fmts = fmt.split(",")
    if len(fmts) != len(out_sizes):
        raise ValueError(f"format {fmt!r} does not name one format per part of {out_sizes}")
    groups: list[tuple[int, str]] = []
    for size, part_fmt in zip(out_sizes, fmts):
        if groups and groups[-1][1] == part_fmt:
            groups[-1] = (groups[-1][0] + size, part_fmt)
        else:
            groups.append((size, part_fmt))
    return groups
