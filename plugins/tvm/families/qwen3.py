"""Qwen3 (GGUF architecture `qwen3`), dense models.

A Llama whose Q and K are RMS-normalized per head (`attn_q_norm`,
`attn_k_norm`, one weight of head_dim) before RoPE, with no biases; the
head dimension (128) is set on its own (`qwen3.attention.key_length`), not
hidden / heads. Q/K rows are not permuted by the converter.
"""

from __future__ import annotations

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """The shared decoder with per-head Q/K norms."""

    def __init__(self, config: ModelConfig, target, formats: dict | None = None) -> None:
        if not config.qk_norm:
            raise ModelLoadError("a qwen3 GGUF file carries per-head Q/K norms (blk.N.attn_q_norm.weight); this one has none")
        super().__init__(config, target, formats)
