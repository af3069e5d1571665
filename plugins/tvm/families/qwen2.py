"""Qwen2: Qwen2, Qwen2.5 and DeepSeek-R1-Distill-Qwen (GGUF architecture
`qwen2`).

A Llama with biases on the Q, K and V projections (not on the output
projection or the MLP). llama.cpp's converter leaves Q/K rows in Hugging
Face's order for this architecture (its RoPE is the NeoX, rotate-half kind),
so nothing is permuted at load. Small models tie the LM head to the
embeddings.
"""

from __future__ import annotations

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """The shared decoder with Q/K/V biases (`attn_q.bias`, ...)."""

    def __init__(self, config: ModelConfig, target, formats: dict | None = None) -> None:
        if not config.attention_bias:
            raise ModelLoadError("a qwen2 GGUF file carries Q/K/V biases (blk.N.attn_q.bias); this one has none")
        super().__init__(config, target, formats)
