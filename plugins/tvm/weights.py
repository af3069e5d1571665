"""Read a model's weights from a GGUF file into the layout `layers.py` expects.

GGUF stores each matrix in ggml order: `tensor.shape` is (in, out) and the
data, dequantized, is a row-major (out, in) array. For the `llama`
architecture llama.cpp's converter also permutes the rows of Q and K for its
interleaved-pair RoPE, while the TVM KV cache applies the rotate-half RoPE of
Hugging Face models, so those rows are permuted back here (`permuted_qk`;
Qwen and Gemma files are written in rotate-half order already).

The tensors come from a tensor source (`gguf_tensors.GGUFTensors`,
`lockgate.models.hf.HFTensors`, or either through `QuantizedAtLoad`). Each
weight keeps its own tensor's format (`linear_formats`): the packed types of
`formats.FORMATS` stay packed (on the CPU their parts are laid out as column
panels like any other weight, and `layers.Linear` dequantizes as it
multiplies), F16 weights stay f16, F32 weights f32, and other GGML types are
widened to f16, which `load_report` warns of. On CUDA (`gpu=True`) the same
parts stay packed in (out, in) order (`layers.GPULinear`), and every
unpacked weight is float16. A separate embedding table is kept the same
way, in rows (`layers.Embedding`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Iterator

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.memory import trim_allocator
from lockgate.models.config import ModelConfig
from lockgate.models.model_file import ModelFile
from lockgate.plugins.tvm.formats import FORMATS, pack_blocks, split_groups
from lockgate.plugins.tvm.gguf_tensors import FORMAT_OF_TYPE, PLAIN_TYPES, TYPE_OF_FORMAT, GGUFTensors
from lockgate.plugins.tvm.weight_streaming import Allocate, streamed_module

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
        return pack_blocks(blocks, rows, cols, fmt)


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


def _tensor_format(tensors: GGUFTensors, name: str, cols: int) -> str:
    """How one tensor is stored: its GGML type's format, or "f16" for a
    type no kernel reads (and for blocks that do not tile the rows)."""
    fmt = FORMAT_OF_TYPE.get(tensors.tensor_type(name), "f16")
    if fmt in FORMATS and cols % FORMATS[fmt].block:
        return "f16"
    return fmt


def linear_formats(tensors: GGUFTensors, config: ModelConfig) -> dict[str, str]:
    """How each linear module's weight is stored, keyed by module name
    ("layers.3.mlp.down_proj", "lm_head", and "embed_tokens" for a separate
    embedding table): "f32", "f16" or a packed format of `formats.FORMATS`,
    each tensor in its own GGML type's format.

    A fused module (q/k/v, gate/up) whose tensors differ in format gets
    one format per tensor, comma-separated ("q4_k,q4_k,q6_k"): the model
    builds it as a `layers.SplitLinear`, each part packed as its file has it.
    Types no kernel reads are widened to f16 (`load_report` warns of them).
    """
    formats = {}
    for module, parts in _linear_sources(config, "output.weight" in tensors).items():
        cols = _in_features(config, module)
        found = [_tensor_format(tensors, name, cols) for name, _, _ in parts]
        formats[module] = found[0] if len(set(found)) == 1 else ",".join(found)
    if not config.tie_word_embeddings:
        formats["embed_tokens"] = _tensor_format(tensors, "token_embd.weight", config.hidden_size)
    return formats


def _module_sources(
    c: ModelConfig, has_output: bool, permuted_qk: bool, formats: dict[str, str]
) -> dict[str, tuple[list[tuple[str, int, int]], str]]:
    """Each weight-holding module of the network, as (GGUF tensors, format):
    the linear modules, the parts of a split fused module (`module.part0`,
    …: runs of tensors of one format), and a separate embedding table."""
    modules = {}
    for module, parts in _linear_sources(c, has_output, permuted_qk).items():
        fmt = formats.get(module, "f32")
        if "," not in fmt:
            modules[module] = (parts, fmt)
            continue
        start = 0
        for i, (size, part_fmt) in enumerate(split_groups(fmt, tuple(rows for _, rows, _ in parts))):
            group, covered = [], 0
            while covered < size:
                group.append(parts[start])
                covered += parts[start][1]
                start += 1
            modules[f"{module}.part{i}"] = (group, part_fmt)
    if not c.tie_word_embeddings:
        modules["embed_tokens"] = ([("token_embd.weight", c.vocab_size, 0)], formats.get("embed_tokens", "f16"))
    return modules


def _linear_arrays(
    t: GGUFTensors,
    c: ModelConfig,
    module: str,
    parts: list[tuple[str, int, int]],
    fmt: str,
    gpu: bool = False,
) -> dict[str, np.ndarray]:
    """A linear module's parameters: in (rows, out) layout on the CPU, rows
    being the input features (or their groups for a packed format's
    parts); with `gpu`, and for an embedding table on either target, (out,
    rows) as `layers.GPULinear` and `layers.Embedding` keep them. A weight
    not packed is float16 on CUDA, and on the CPU as its format says."""
    base = module.split(".part")[0]
    cols = _in_features(c, base)
    rows_layout = gpu or base == "embed_tokens"
    if fmt in FORMATS:
        pieces = [t.quantized(name, rows, cols, fmt) for name, rows, _ in parts]
        for piece, (_, _, heads) in zip(pieces, parts):
            if heads:
                for key in piece:
                    piece[key] = undo_rope_permutation(piece[key], heads)
        # one tensor's parts are its own new arrays: no copy to join them
        out = {
            f"{module}.{key}": pieces[0][key] if len(pieces) == 1 else np.concatenate([p[key] for p in pieces], axis=0)
            for key in pieces[0]
        }
        return out if rows_layout else {name: array.T for name, array in out.items()}
    # read in the stored dtype: an f16 weight of an F16 file is never widened
    dtype = np.float16 if gpu or fmt == "f16" else np.float32
    matrices = []
    for name, rows, heads in parts:
        w = t.matrix(name, rows, cols, dtype)
        matrices.append(undo_rope_permutation(w, heads) if heads else w)
    weight = matrices[0] if len(matrices) == 1 else np.concatenate(matrices, axis=0)
    return {f"{module}.weight": weight if rows_layout else weight.T}


def iter_gguf_weights(
    tensors: GGUFTensors,
    config: ModelConfig,
    param_names: Iterable[tuple[str, tuple[int, ...]]],
    progress: Callable[[str], None] | None = None,
    formats: dict[str, str] | None = None,
    gpu: bool = False,
    permuted_qk: bool = True,
    contiguous: bool = True,
    allocate: Allocate | None = None,
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
    :param contiguous: False yields an array in its final layout but
        possibly a strided view (a transposed, paneled weight), for a
        caller that copies it into its destination in one pass anyway:
        making it contiguous first is a second full copy of the weight.
    :param allocate: where to write packed modules chunk by chunk
        (`weight_streaming.Uploads.allocate`); None reads each tensor whole.
    :raises ModelLoadError: a tensor is missing, mis-shaped or of a type that
        cannot be dequantized.
    """
    c = config
    formats = formats or {}
    sources = _module_sources(c, "output.weight" in tensors, permuted_qk, formats)
    release = getattr(tensors, "release_pages", None)
    by_name: dict[str, np.ndarray] = {}
    by_name["norm.weight"] = tensors.vector("output_norm.weight", c.hidden_size)
    loaded: set[str] = set()
    param_names = list(param_names)
    shapes = dict(param_names)
    for name, shape in param_names:
        module = name.rsplit(".", 1)[0]
        if name not in by_name and module in sources and module not in loaded:
            if progress is not None and module.endswith("qkv_proj"):
                layer = int(module.split(".")[1])
                if layer % 10 == 0:
                    progress(f"loading weights: layer {layer + 1}/{c.num_layers}")
            module_parts, fmt = sources[module]
            base = module.split(".part")[0]
            streamed = None if allocate is None else streamed_module(
                tensors, module, module_parts, fmt, _in_features(c, base), shapes, gpu or base == "embed_tokens",
                allocate, release, undo_rope_permutation)
            by_name.update(streamed if streamed is not None else _linear_arrays(tensors, c, module, module_parts, fmt, gpu))
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
        yield np.ascontiguousarray(array) if contiguous else array
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


def _format_bits(fmt: str) -> float:
    return {"f32": 32.0, "f16": 16.0}.get(fmt) or FORMATS[fmt].bits_per_weight


def load_report(tensors: GGUFTensors, config: ModelConfig, formats: dict[str, str]) -> dict:
    """What the model's weight matrices run as: per format, the tensors and
    their bytes as loaded and as in the file; and the tensors of a type no
    kernel reads, widened to f16, with what that costs.

    Returns {"formats": [{"format", "tensors", "bytes", "file_bytes"}, …]
    (largest first), "widened": [{"tensor", "type", "bytes", "file_bytes"},
    …]}; `bytes` count what the packed parts take, `file_bytes` the GGML
    blocks they came from.
    """
    rows_by_format: dict[str, dict] = {}
    widened = []
    for module, (parts, fmt) in _module_sources(config, "output.weight" in tensors, False, formats).items():
        cols = _in_features(config, module.split(".part")[0])
        for name, rows, _ in parts:
            qtype = tensors.tensor_type(name)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            file_bytes = rows * cols // block * block_bytes
            stored = int(rows * cols * _format_bits(fmt) / 8)
            entry = rows_by_format.setdefault(fmt, {"format": fmt, "tensors": 0, "bytes": 0, "file_bytes": 0})
            entry["tensors"] += 1
            entry["bytes"] += stored
            entry["file_bytes"] += file_bytes
            if FORMAT_OF_TYPE.get(qtype) != fmt:
                widened.append({"tensor": name, "type": qtype.name, "bytes": stored, "file_bytes": file_bytes})
    ordered = sorted(rows_by_format.values(), key=lambda row: -row["bytes"])
    return {"formats": ordered, "widened": widened}


def describe_load_report(report: dict) -> str:
    """The report on one line: "q4_k 98 tensors 61.2 MiB (file 59.8 MiB), …"."""
    mib = 1 << 20
    return ", ".join(
        f"{row['format']} {row['tensors']} tensors {row['bytes'] / mib:.1f} MiB (file {row['file_bytes'] / mib:.1f} MiB)"
        for row in report["formats"]
    )


# ------------------------------------------------------------------ loading helpers


def release_loading_memory() -> None:
    """Return what loading the weights left behind to the OS.

    Repacking the GGUF tensors leaves reference cycles holding temporary
    arrays, and glibc keeps freed heap pages mapped; together about 130 MiB
    of resident memory on the default model until both are released.
    """
    gc.collect()
    trim_allocator()


def open_tensors(model_file: ModelFile):
    """The model's tensors under llama.cpp's names: a GGUF file's, or a
    Hugging Face directory's safetensors."""
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors

    if os.path.isdir(model_file.path):
        from lockgate.models.hf import HFTensors

        return HFTensors(model_file.path, model_file.family)
    try:
        # the header as the loader already read it, else read here: once either way
        source = model_file.metadata if model_file.metadata is not None else model_file.path
        return GGUFTensors(source)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {model_file.path}: {exc}") from exc
