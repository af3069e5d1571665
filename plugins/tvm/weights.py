"""Read llama weights from a GGUF file into the layout `model.py` expects.

GGUF stores each matrix in ggml order: `tensor.shape` is (in, out) and the
data, dequantized, is a row-major (out, in) array. llama.cpp's converter also
permutes the rows of Q and K for its interleaved-pair RoPE, while the TVM KV
cache applies the rotate-half RoPE of Hugging Face models, so those rows are
permuted back here. Everything is dequantized to float32 for now.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.model_config import LlamaConfig

_PLAIN_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


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


def undo_rope_permutation(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation on an (out, in) matrix."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"Q/K matrix with {rows} rows cannot hold {n_head} heads")
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """One tensor of a GGUF file: ggml shape (innermost first), type, bytes."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_index(path: str | os.PathLike) -> dict[str, RawTensor]:
    """The tensors of a GGUF file, memory-mapped, without parsing metadata.

    `gguf.GGUFReader` turns every metadata array (a 49k-entry vocabulary and
    merge list for SmolLM2) into numpy objects, which takes seconds; the
    weights need only the tensor table, so the metadata is skipped over.
    """
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def skip_value(value_type: int) -> None:
        nonlocal pos
        if value_type == _STRING:
            length = take("Q")
            pos += length
        elif value_type == _ARRAY:
            item_type, count = take("IQ")
            if item_type in _SCALAR_SIZES:
                pos += _SCALAR_SIZES[item_type] * count
            else:
                for _ in range(count):
                    skip_value(item_type)
        elif value_type in _SCALAR_SIZES:
            pos += _SCALAR_SIZES[value_type]
        else:
            raise ModelLoadError(f"GGUF metadata value of unknown type {value_type}")

    try:
        if bytes(buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        pos = 4
        version = take("I")
        if version < 2:
            raise ModelLoadError(f"GGUF version {version} is not supported")
        tensor_count, kv_count = take("QQ")
        alignment = 32
        for _ in range(kv_count):
            length = take("Q")
            key = bytes(buf[pos : pos + length]).decode()
            pos += length
            value_type = take("I")
            if key == "general.alignment" and value_type == 4:
                alignment = take("I")
            else:
                skip_value(value_type)
        infos = []
        for _ in range(tensor_count):
            length = take("Q")
            name = bytes(buf[pos : pos + length]).decode()
            pos += length
            n_dims = take("I")
            shape = tuple(take("Q") for _ in range(n_dims))
            qtype = gguf.GGMLQuantizationType(take("I"))
            infos.append((name, shape, qtype, take("Q")))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"malformed GGUF file {path}: {exc}") from exc
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * block_bytes
        raw = data[start + offset : start + offset + nbytes]
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            raw = raw.view(np.float16)
        tensors[name] = RawTensor(name, shape, qtype, raw)
    return tensors


class GGUFTensors:
    """Named float32 access to the tensors of one GGUF file."""

    def __init__(self, source) -> None:
        if isinstance(source, gguf.GGUFReader):
            self._tensors = {t.name: t for t in source.tensors}
        else:
            self._tensors = read_tensor_index(source)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def matrix(self, name: str, rows: int, cols: int) -> np.ndarray:
        """The tensor as a float32 (rows, cols) = (out, in) array."""
        return self._read(name, (rows, cols))

    def vector(self, name: str, size: int) -> np.ndarray:
        return self._read(name, (size,))

    def _read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        ggml_shape = tuple(int(d) for d in tensor.shape)
        if ggml_shape != tuple(reversed(shape)):
            raise ModelLoadError(
                f"tensor {name!r} has shape {list(ggml_shape)} (ggml order), "
                f"expected {list(reversed(shape))}"
            )
        qtype = tensor.tensor_type
        try:
            if qtype in _PLAIN_TYPES:
                values = np.asarray(tensor.data, dtype=np.float32)
            elif qtype in _FAST_DEQUANTIZE:
                values = _FAST_DEQUANTIZE[qtype](np.asarray(tensor.data, dtype=np.uint8))
            else:
                values = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"tensor {name!r} has GGML type {qtype.name}, which cannot be dequantized"
            ) from exc
        return np.asarray(values, dtype=np.float32).reshape(shape)


def to_panels(w: np.ndarray, width: int) -> np.ndarray:
    """(in, out) -> (out / width, in, width): contiguous column panels."""
    k, n = w.shape
    if n % width:
        raise ModelLoadError(f"{n} output columns do not split into panels of {width}")
    return w.reshape(k, n // width, width).transpose(1, 0, 2)


def _layer_arrays(t: GGUFTensors, c: LlamaConfig, i: int) -> dict[str, np.ndarray]:
    p = f"blk.{i}."
    h, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q = undo_rope_permutation(t.matrix(p + "attn_q.weight", q_rows, h), c.num_heads)
    k = undo_rope_permutation(t.matrix(p + "attn_k.weight", kv_rows, h), c.num_kv_heads)
    v = t.matrix(p + "attn_v.weight", kv_rows, h)
    gate = t.matrix(p + "ffn_gate.weight", c.intermediate_size, h)
    up = t.matrix(p + "ffn_up.weight", c.intermediate_size, h)
    m = f"layers.{i}."
    return {
        m + "input_layernorm.weight": t.vector(p + "attn_norm.weight", h),
        m + "self_attn.qkv_proj.weight": np.concatenate([q, k, v], axis=0).T,
        m + "self_attn.o_proj.weight": t.matrix(p + "attn_output.weight", h, q_rows).T,
        m + "post_attention_layernorm.weight": t.vector(p + "ffn_norm.weight", h),
        m + "mlp.gate_up_proj.weight": np.concatenate([gate, up], axis=0).T,
        m + "mlp.down_proj.weight": t.matrix(p + "ffn_down.weight", h, c.intermediate_size).T,
    }


def load_gguf_weights(
    source,
    config: LlamaConfig,
    param_names: Iterable[tuple[str, tuple[int, ...]]],
    progress: Callable[[str], None] | None = None,
) -> list[np.ndarray]:
    """The model's parameters as contiguous float32 arrays, in the given order.

    :param source: the GGUF file's path, or a `gguf.GGUFReader` of it.
    :param param_names: (name, shape) of every parameter of
        `model.LlamaForCausalLM`, in its `named_parameters` order; a 3-D shape
        asks for the paneled (out / panel, in, panel) layout.
    :raises ModelLoadError: a tensor is missing, mis-shaped or of a type that
        cannot be dequantized.
    """
    return list(iter_gguf_weights(source, config, param_names, progress))


def iter_gguf_weights(
    source,
    config: LlamaConfig,
    param_names: Iterable[tuple[str, tuple[int, ...]]],
    progress: Callable[[str], None] | None = None,
) -> Iterator[np.ndarray]:
    """`load_gguf_weights` one array at a time, so a caller that copies each
    to a device never holds the whole float32 model twice."""
    t = GGUFTensors(source)
    c = config
    by_name: dict[str, np.ndarray] = {}
    embed = t.matrix("token_embd.weight", c.vocab_size, c.hidden_size)
    if c.tie_word_embeddings:
        by_name["lm_head.weight"] = embed.T
    else:
        by_name["embed_tokens"] = embed
        by_name["lm_head.weight"] = t.matrix("output.weight", c.vocab_size, c.hidden_size).T
    by_name["norm.weight"] = t.vector("output_norm.weight", c.hidden_size)
    layers_done = -1
    for name, shape in param_names:
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if layer > layers_done:
                if progress is not None and layer % 10 == 0:
                    progress(f"loading weights: layer {layer + 1}/{c.num_layers}")
                by_name.update(_layer_arrays(t, c, layer))
                layers_done = layer
        array = by_name.pop(name, None)
        if array is None:
            raise ModelLoadError(f"no GGUF tensor provides parameter {name!r}")
        if len(shape) == 3 and array.ndim == 2:
            array = to_panels(array, shape[2])
        if tuple(array.shape) != tuple(shape):
            raise ModelLoadError(
                f"parameter {name!r} has shape {list(array.shape)}, the model expects {list(shape)}"
            )
        yield np.ascontiguousarray(array, dtype=np.float32)
