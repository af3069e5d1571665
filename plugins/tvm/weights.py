"""Read llama weights from a GGUF file into the layout `model.py` expects.

GGUF stores each matrix in ggml order: `tensor.shape` is (in, out) and the
data, dequantized, is a row-major (out, in) array. llama.cpp's converter also
permutes the rows of Q and K for its interleaved-pair RoPE, while the TVM KV
cache applies the rotate-half RoPE of Hugging Face models, so those rows are
permuted back here. Everything is dequantized to float32 for now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.model_config import LlamaConfig

_PLAIN_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


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


class GGUFTensors:
    """Named float32 access to the tensors of one GGUF file."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._tensors = {t.name: t for t in reader.tensors}

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
    reader: gguf.GGUFReader,
    config: LlamaConfig,
    param_names: Iterable[tuple[str, tuple[int, ...]]],
    progress: Callable[[str], None] | None = None,
) -> list[np.ndarray]:
    """The model's parameters as contiguous float32 arrays, in the given order.

    :param param_names: (name, shape) of every parameter of
        `model.LlamaForCausalLM`, in its `named_parameters` order; a 3-D shape
        asks for the paneled (out / panel, in, panel) layout.
    :raises ModelLoadError: a tensor is missing, mis-shaped or of a type that
        cannot be dequantized.
    """
    t = GGUFTensors(reader)
    c = config
    by_name: dict[str, np.ndarray] = {}
    embed = t.matrix("token_embd.weight", c.vocab_size, c.hidden_size)
    if c.tie_word_embeddings:
        by_name["lm_head.weight"] = embed.T
    else:
        by_name["embed_tokens"] = embed
        by_name["lm_head.weight"] = t.matrix("output.weight", c.vocab_size, c.hidden_size).T
    by_name["norm.weight"] = t.vector("output_norm.weight", c.hidden_size)
    out: list[np.ndarray] = []
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
        out.append(np.ascontiguousarray(array, dtype=np.float32))
    return out
