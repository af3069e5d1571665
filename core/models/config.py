"""The shape and numerics of a decoder-only model, read from a GGUF file's
metadata.

llama.cpp's converter writes the same keys for every architecture, under
the architecture's own prefix (`qwen2.embedding_length`,
`gemma3.attention.sliding_window`, ...), and marks optional parts by the
tensors it writes (Q/K/V biases, per-head Q/K norms, `rope_freqs.weight`).
So one reader serves every family; which architectures can actually run is
the families' business (`lockgate.models.families`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lockgate.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything an executor needs to build the network; the weights are
    read separately from the same file.

    The defaults describe a plain Llama; a family reads what differs.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    #: `general.architecture` of the file ("llama", "qwen2", ...)
    architecture: str = "llama"
    #: the leading features of each head that RoPE rotates
    rotary_dim: int | None = None
    #: Q, K and V projections carry a bias (Qwen2)
    attention_bias: bool = False
    #: Q and K are RMS-normalized per head before RoPE (Qwen3, Gemma 3)
    qk_norm: bool = False
    #: positions are multiplied by this before RoPE (linear RoPE scaling)
    rope_scale: float = 1.0
    #: per-frequency divisors of RoPE (`rope_freqs.weight`: Llama 3.1+'s
    #: "llama3" scaling, precomputed by the converter); None: none
    rope_freq_factors: tuple[float, ...] | None = None
    #: keys a sliding-window (local) layer attends to, itself included;
    #: 0: every layer attends to the whole sequence
    sliding_window: int = 0
    #: which layers slide: one flag per layer, or every n-th layer global
    #: (`n`: layers i with i % n < n - 1 slide, as llama.cpp reads it);
    #: None: the family's own pattern
    sliding_window_pattern: int | tuple[bool, ...] | None = None
    #: RoPE base of the sliding-window layers (`rope.freq_base_swa`)
    rope_local_theta: float | None = None
    #: logits are squashed to ±this by tanh (`final_logit_softcapping`); 0: not
    final_logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_gguf(cls, reader) -> "ModelConfig":
        """Read the config from a GGUF file's metadata: a
        `lockgate.models.gguf_metadata.GGUFMetadata` or a `gguf.GGUFReader`.

        :raises ModelLoadError: a required key is missing, or the file asks
            for a RoPE scaling this reader does not know.
        """
        fields = reader.fields
        arch = _get(fields, "general.architecture")
        tensor_names = {t.name for t in reader.tensors}

        def get(key: str, default: Any = None) -> Any:
            return _get(fields, f"{arch}.{key}", default)

        def optional(key: str) -> Any:
            field = fields.get(f"{arch}.{key}")
            return None if field is None else field.contents()

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        vocab = fields.get(f"{arch}.vocab_size")
        if vocab is not None:
            vocab_size = int(vocab.contents())
        else:
            vocab_size = len(_get(fields, "tokenizer.ggml.tokens"))
        head_dim = int(get("attention.key_length", 0)) or hidden // heads
        value_dim = int(get("attention.value_length", 0)) or head_dim
        if value_dim != head_dim:
            raise ModelLoadError(
                f"heads with {head_dim} key and {value_dim} value features are not supported"
            )
        rope_scale, factors = _rope_scaling(reader, arch, get, tensor_names, head_dim)
        window = int(get("attention.sliding_window", 0))
        pattern = optional("attention.sliding_window_pattern") if window else None
        if isinstance(pattern, list):
            pattern = tuple(bool(flag) for flag in pattern)
        elif pattern is not None:
            pattern = int(pattern)
        local_theta = optional("rope.freq_base_swa") if window else None
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            architecture=str(arch),
            rotary_dim=int(get("rope.dimension_count", head_dim)),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scale=rope_scale,
            rope_freq_factors=factors,
            sliding_window=window,
            sliding_window_pattern=pattern,
            rope_local_theta=None if local_theta is None else float(local_theta),
            final_logit_softcap=float(optional("final_logit_softcapping") or 0.0),
        )


def _get(fields, key: str, default: Any = None) -> Any:
    field = fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _rope_scaling(reader, arch: str, get, tensor_names: set[str], head_dim: int):
    """(position scale, frequency factors) of the file's RoPE scaling.

    llama.cpp's converter writes Llama 3.1's "llama3" scaling as the tensor
    `rope_freqs.weight`, one divisor per rotated frequency; linear scaling
    as `rope.scaling.type` "linear" and its factor. Others (YaRN, LongRoPE)
    would run silently wrong, so they are refused.
    """
    kind = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", 1.0))
    scale = 1.0
    if kind == "linear" and factor not in (0.0, 1.0):
        scale = 1.0 / factor
    elif kind not in ("none", "linear") and "rope_freqs.weight" not in tensor_names:
        raise ModelLoadError(
            f"RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported; "
            "supported: none, linear, and llama3 (rope_freqs.weight)"
        )
    if "rope_freqs.weight" not in tensor_names:
        return scale, None
    info = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    values = _read_f32_vector(reader, info)
    rotary = int(get("rope.dimension_count", head_dim))
    if values.size != rotary // 2:
        raise ModelLoadError(
            f"rope_freqs.weight holds {values.size} factors, expected {rotary // 2} "
            f"(half of {rotary} rotated features)"
        )
    return scale, tuple(float(v) for v in values)


def _read_f32_vector(reader, info) -> np.ndarray:
    """A small float32 tensor's values, from either kind of reader."""
    data = getattr(info, "data", None)
    if data is not None:  # gguf.GGUFReader
        return np.asarray(data, dtype=np.float32).ravel()
    if info.ggml_type != 0:  # GGML_TYPE_F32
        raise ModelLoadError(f"tensor {info.name!r} has GGML type {info.ggml_type}, expected F32")
    count = int(np.prod(info.shape))
    start = reader.data_offset + info.offset
    with open(reader.path, "rb") as file:
        file.seek(start)
        raw = file.read(4 * count)
    if len(raw) != 4 * count:
        raise ModelLoadError(f"malformed GGUF file {reader.path}: tensor {info.name} runs past the end")
    return np.frombuffer(raw, dtype=np.float32)
