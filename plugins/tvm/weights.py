"""Read a model's weights from a GGUF file into the layout `layers.py` expects.

GGUF stores each matrix in ggml order: `tensor.shape` is (in, out) and the
data, dequantized, is a row-major (out, in) array. For the `llama`
architecture llama.cpp's converter also permutes the rows of Q and K for its
interleaved-pair RoPE, while the TVM KV cache applies the rotate-half RoPE of
Hugging Face models, so those rows are permuted back here (`permuted_qk`;
Qwen and Gemma files are written in rotate-half order already).

The tensors come from a tensor source (`gguf_tensors.GGUFTensors`,
`lockgate.models.hf.HFTensors`, or either through `QuantizedAtLoad`). On the
CPU the linear weights of Q4_0, Q4_1 and Q8_0 stay quantized (codes and
scales laid out as column panels like any other weight; `layers.Linear`
dequantizes as it multiplies); F16 weights stay f16, F32 weights f32; other
GGML types are dequantized to f16. On CUDA (`gpu=True`) the same codes stay
packed, but in (out, in) order with float16 scales (`layers.GPULinear`), and
every unpacked weight is float16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.gguf_tensors import (
    FORMAT_OF_TYPE,
    PLAIN_TYPES,
    QUANTIZED_FORMATS,
    TYPE_OF_FORMAT,
    GGUFTensors,
    codes_of_blocks,
)

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


class QuantizedAtLoad:
    """Another tensor source (`GGUFTensors`, `lockgate.models.hf.HFTensors`)
    whose float linear matrices are packed into `fmt` ("q8_0" or "q4_0") as
    they are read (`--quantize`): they report that type, and `quantized`
    quantizes them with gguf-py, llama.cpp's own reference rounding.
    Norms, biases, the separate embedding table and matrices whose rows are
    not whole blocks keep their type; tensors already packed keep theirs.
    """

    def __init__(self, tensors, fmt: str, config: ModelConfig) -> None:
        if fmt not in ("q8_0", "q4_0"):
            raise ModelLoadError(f"cannot quantize at load to {fmt!r}: choose q8_0 or q4_0")
        self._tensors = tensors
        self._fmt = fmt
        self._linear = {
            name
            for module, parts in _linear_sources(config, "output.weight" in tensors).items()
            if _in_features(config, module) % 32 == 0
            for name, _, _ in parts
        }

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType | None:
        qtype = self._tensors.tensor_type(name)
        if name in self._linear and qtype in PLAIN_TYPES:
            return TYPE_OF_FORMAT[self._fmt]
        return qtype

    def matrix(self, name: str, rows: int, cols: int, dtype=np.float32) -> np.ndarray:
        return self._tensors.matrix(name, rows, cols, dtype)

    def vector(self, name: str, size: int) -> np.ndarray:
        return self._tensors.vector(name, size)

    def quantized(self, name: str, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
        if self._tensors.tensor_type(name) not in PLAIN_TYPES:
            return self._tensors.quantized(name, rows, cols, fmt)
        qtype = TYPE_OF_FORMAT[fmt]
        blocks = gguf.quants.quantize(self._tensors.matrix(name, rows, cols), qtype)
        return codes_of_blocks(np.asarray(blocks, dtype=np.uint8), rows, cols, fmt)


def to_panels(w: np.ndarray, width: int) -> np.ndarray:
    """(rows, out) -> (out / width, rows, width): contiguous column panels."""
    k, n = w.shape
    if n % width:
        raise ModelLoadError(f"{n} output columns do not split into panels of {width}")
    return w.reshape(k, n // width, width).transpose(1, 0, 2)


def _linear_sources(
    c: ModelConfig, has_output: bool, permuted_qk: bool = True
) -> dict[str, list[tuple[str, int, int]]]:
    """Each linear module's GGUF tensors as (name, rows, heads to un-permute)."""
    h, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q_heads, kv_heads = (c.num_heads, c.num_kv_heads) if permuted_qk else (0, 0)
    sources = {}
    for i in range(c.num_layers):
        p, m = f"blk.{i}.", f"layers.{i}."
        sources[m + "self_attn.qkv_proj"] = [
            (p + "attn_q.weight", q_rows, q_heads),
            (p + "attn_k.weight", kv_rows, kv_heads),
            (p + "attn_v.weight", kv_rows, 0),
        ]
        sources[m + "self_attn.o_proj"] = [(p + "attn_output.weight", h, 0)]
        sources[m + "mlp.gate_up_proj"] = [
            (p + "ffn_gate.weight", c.intermediate_size, 0),
            (p + "ffn_up.weight", c.intermediate_size, 0),
        ]
        sources[m + "mlp.down_proj"] = [(p + "ffn_down.weight", h, 0)]
    head = "output.weight" if has_output and not c.tie_word_embeddings else "token_embd.weight"
    sources["lm_head"] = [(head, c.vocab_size, 0)]
    return sources


def _in_features(c: ModelConfig, module: str) -> int:
    if module.endswith("down_proj"):
        return c.intermediate_size
    if module.endswith("o_proj"):
        return c.num_heads * c.head_dim
    return c.hidden_size


def linear_formats(tensors: GGUFTensors, config: ModelConfig) -> dict[str, str]:
    """How each linear module's weight is stored: "f32", "f16", "q8_0",
    "q4_0" or "q4_1", keyed by module name ("layers.3.mlp.down_proj",
    "lm_head").

    A fused module (q/k/v, gate/up) keeps its format only when all of its
    tensors share it; otherwise, and for GGML types the kernels do not
    handle, it falls back to f16.
    """
    formats = {}
    for module, parts in _linear_sources(config, "output.weight" in tensors).items():
        found = {FORMAT_OF_TYPE.get(tensors.tensor_type(name)) for name, _, _ in parts}
        fmt = found.pop() if len(found) == 1 and None not in found else "f16"
        if fmt in QUANTIZED_FORMATS and _in_features(config, module) % 32:
            fmt = "f16"
        formats[module] = fmt
    return formats


def _linear_arrays(
    t: GGUFTensors,
    c: ModelConfig,
    module: str,
    parts: list[tuple[str, int, int]],
    fmt: str,
    gpu: bool = False,
) -> dict[str, np.ndarray]:
    """A linear module's parameters in (rows, out) layout, rows being the
    input features (or their groups of 8 / 32 for codes and scales); with
    `gpu`, (out, rows) as `model.GPULinear` keeps them, float16 scales and
    weights (anything not kept packed becomes float16)."""
    cols = _in_features(c, module)
    if fmt in QUANTIZED_FORMATS:
        pieces = [t.quantized(name, rows, cols, fmt) for name, rows, _ in parts]
        for piece, (_, _, heads) in zip(pieces, parts):
            if heads:
                for key in piece:
                    piece[key] = undo_rope_permutation(piece[key], heads)
        out = {
            f"{module}.{key}": np.concatenate([p[key] for p in pieces], axis=0)
            for key in pieces[0]
        }
        if not gpu:
            return {name: array.T for name, array in out.items()}
        # the file's scales are float16: the cast back is exact
        return {
            name: array if name.endswith(".codes") else array.astype(np.float16)
            for name, array in out.items()
        }
    # read in the stored dtype: an f16 weight of an F16 file is never widened
    dtype = np.float16 if gpu or fmt == "f16" else np.float32
    matrices = []
    for name, rows, heads in parts:
        w = t.matrix(name, rows, cols, dtype)
        matrices.append(undo_rope_permutation(w, heads) if heads else w)
    weight = matrices[0] if len(matrices) == 1 else np.concatenate(matrices, axis=0)
    return {f"{module}.weight": weight if gpu else weight.T}


def iter_gguf_weights(
    tensors: GGUFTensors,
    config: ModelConfig,
    param_names: Iterable[tuple[str, tuple[int, ...]]],
    progress: Callable[[str], None] | None = None,
    formats: dict[str, str] | None = None,
    gpu: bool = False,
    permuted_qk: bool = True,
) -> Iterator[np.ndarray]:
    """The model's parameters as contiguous arrays, in the given order, one
    at a time, so a caller that copies each to a device never holds the
    whole model twice.

    :param tensors: the GGUF file's tensors.
    :param param_names: (name, shape) of every parameter of
        `model.LlamaForCausalLM`, in its `named_parameters` order; a 3-D shape
        asks for the paneled (out / panel, rows, panel) layout.
    :param formats: `linear_formats` of the compiled model; None stores
        every linear weight as float32 (float16 with `gpu`).
    :param gpu: the CUDA layout of `model.GPULinear`: (out, in) weights,
        packed codes with float16 scales, a float16 embedding table.
    :param permuted_qk: the file's Q/K rows are in llama.cpp's interleaved
        RoPE order (`ModelFamily.permuted_qk`) and are put back.
    :raises ModelLoadError: a tensor is missing, mis-shaped or of a type that
        cannot be dequantized.
    """
    c = config
    sources = _linear_sources(c, "output.weight" in tensors, permuted_qk)
    release = getattr(tensors, "release_pages", None)
    formats = formats or {}
    by_name: dict[str, np.ndarray] = {}
    if not c.tie_word_embeddings:
        by_name["embed_tokens"] = tensors.matrix(
            "token_embd.weight", c.vocab_size, c.hidden_size, np.float16 if gpu else np.float32
        )
    by_name["norm.weight"] = tensors.vector("output_norm.weight", c.hidden_size)
    loaded: set[str] = set()
    for name, shape in param_names:
        module = name.rsplit(".", 1)[0]
        if name not in by_name and module in sources and module not in loaded:
            if progress is not None and module.endswith("qkv_proj"):
                layer = int(module.split(".")[1])
                if layer % 10 == 0:
                    progress(f"loading weights: layer {layer + 1}/{c.num_layers}")
            by_name.update(
                _linear_arrays(tensors, c, module, sources[module], formats.get(module, "f32"), gpu)
            )
            loaded.add(module)
        elif name not in by_name and name.startswith("layers."):
            array = _layer_vector(tensors, c, name, permuted_qk)
            if array is not None:
                by_name[name] = array.astype(np.float16) if gpu and name.endswith("qkv_bias") else array
        array = by_name.pop(name, None)
        if array is None:
            raise ModelLoadError(f"no GGUF tensor provides parameter {name!r}")
        if len(shape) == 3 and array.ndim == 2:
            array = to_panels(array, shape[2])
        if tuple(array.shape) != tuple(shape):
            raise ModelLoadError(
                f"parameter {name!r} has shape {list(array.shape)}, the model expects {list(shape)}"
            )
        yield np.ascontiguousarray(array)
        del array
        if release is not None:
            release()


def _layer_vector(tensors: GGUFTensors, c: ModelConfig, name: str, permuted_qk: bool) -> np.ndarray | None:
    """A layer's norm weight or bias (float32) by parameter name, None for
    names that are not one."""
    i = int(name.split(".")[1])
    leaf = name.split(".", 2)[2]
    p = f"blk.{i}."
    norms = {
        "input_layernorm.weight": ("attn_norm.weight", c.hidden_size),
        "post_attention_layernorm.weight": ("ffn_norm.weight", c.hidden_size),
        "self_attn.q_norm.weight": ("attn_q_norm.weight", c.head_dim),
        "self_attn.k_norm.weight": ("attn_k_norm.weight", c.head_dim),
        # Gemma 3's norms around attention and MLP
        "post_attention_norm.weight": ("post_attention_norm.weight", c.hidden_size),
        "pre_feedforward_layernorm.weight": ("ffn_norm.weight", c.hidden_size),
        "post_feedforward_layernorm.weight": ("post_ffw_norm.weight", c.hidden_size),
    }
    if leaf in norms:
        tensor, size = norms[leaf]
        values = tensors.vector(p + tensor, size)
        if permuted_qk and "_norm" in leaf and leaf.startswith("self_attn."):
            # the norm's features follow the head's rows, permuted with them
            values = undo_rope_permutation(values, 1)
        return values
    if leaf == "self_attn.qkv_bias":
        parts = [
            ("attn_q.bias", c.num_heads),
            ("attn_k.bias", c.num_kv_heads),
            ("attn_v.bias", 0),
        ]
        pieces = []
        for tensor, heads in parts:
            values = tensors.vector(p + tensor, (heads or c.num_kv_heads) * c.head_dim)
            pieces.append(undo_rope_permutation(values, heads) if permuted_qk and heads else values)
        return np.concatenate(pieces)
    return None
