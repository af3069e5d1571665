"""The architecture of a Llama-family model, read from a GGUF file's metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

from lockgate.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder.

    Everything an executor needs to build the network; weights are read
    separately from the same file.
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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_gguf(cls, reader) -> "LlamaConfig":
        """Read the config from a `gguf.GGUFReader` of a llama-architecture file."""
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(key)
            if field is None:
                if default is None:
                    raise ModelLoadError(f"GGUF metadata lacks {key!r}")
                return default
            return field.contents()

        arch = get("general.architecture")
        if arch != "llama":
            raise ModelLoadError(
                f"unsupported architecture {arch!r}: lockgate runs llama-family GGUF files"
            )
        tensor_names = {t.name for t in reader.tensors}
        hidden = int(get("llama.embedding_length"))
        heads = int(get("llama.attention.head_count"))
        vocab = fields.get("llama.vocab_size")
        if vocab is not None:
            vocab_size = int(vocab.contents())
        else:
            vocab_size = len(fields["tokenizer.ggml.tokens"].data)
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("llama.feed_forward_length")),
            num_layers=int(get("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(get("llama.attention.head_count_kv", heads)),
            head_dim=int(get("llama.rope.dimension_count", hidden // heads)),
            rope_theta=float(get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("llama.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
        )
