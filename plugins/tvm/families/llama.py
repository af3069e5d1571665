"""Llama: Llama 2, 3, 3.1, 3.2 and 3.3, Mistral 7B, Mistral Nemo and Small,
SmolLM, DeepSeek-R1-Distill-Llama: every GGUF file whose architecture is
`llama`.

The plain decoder: SwiGLU MLP, RMS norms before attention and MLP, grouped
Q/K/V heads, RoPE, no biases. Llama 3.1 and later carry RoPE scaling as
per-frequency factors (`rope_freqs.weight`), which the shared decoder hands
to the KV cache. llama.cpp's converter permutes Q and K rows for this
architecture; the weight loader undoes it (`ModelFamily.permuted_qk`).
"""

from __future__ import annotations

from lockgate.plugins.tvm.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The shared decoder as it is: Llama is the shape the others vary."""
