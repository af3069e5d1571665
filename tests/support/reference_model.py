"""An independent numpy forward pass of a GGUF file, as llama.cpp computes it.

Weights are used in the file's own row order: for `llama` files llama.cpp's
RoPE rotates interleaved pairs (2i, 2i+1) of the permuted rows, for Qwen
files it rotates halves (NeoX order). Q/K/V biases, per-head Q/K norms and
Llama 3.1's per-frequency RoPE divisors (`rope_freqs.weight`) are applied
where the file has them, and Gemma 3's block (scaled embeddings, norms after
attention and MLP, GeGLU, sliding-window layers with their own RoPE base,
soft-capped logits) for `gemma3` files. Executors that undo the permutation and rotate
halves must agree with it.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np

from lockgate.models.config import ModelConfig

#: architectures whose RoPE llama.cpp applies to interleaved pairs
INTERLEAVED_ROPE = {"llama"}


def read_tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """A tensor of the file, dequantized, in float64, shaped (out, in)."""
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(reversed([int(d) for d in t.shape]))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        values = np.asarray(t.data, dtype=np.float64)
    else:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    return values.reshape(shape)


def int8_activations(h: np.ndarray, block: int = 32) -> np.ndarray:
    """h as the 8-bit matmuls see it: float32 rows cut into blocks of
    `block` (32, or a K-quant's 256 in AVX2 code: `int8_matmul.activation_block`),
    each rounded to int8 steps of its largest magnitude / 127."""
    x = h.astype(np.float32).reshape(*h.shape[:-1], -1, block)
    amax = np.abs(x).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.round(x * inverse)
    return (q * (amax / np.float32(127))).astype(np.float64).reshape(h.shape)


def reference_logits(path: pathlib.Path, tokens: list[int], int8: bool = False, hidden: bool = False) -> np.ndarray:
    """Logits after every token, (len(tokens), vocab), in float64 (with
    `hidden`, the final hidden states after the last norm instead,
    (len(tokens), hidden_size)); with
    `int8` the activations entering a quantized weight's matmul are rounded
    as lockgate's 8-bit CPU kernels round them (`int8_activations`), and keys
    and values to float16 as its KV cache holds them: a value's rounding
    moves an attention output by up to 1/1000, enough to move one in 20 of
    the 8-bit codes that follow by a step."""
    reader = gguf.GGUFReader(path)
    c = ModelConfig.from_gguf(reader)
    if int8:  # the instruction set of the CPU the executor compiles for
        from lockgate.plugins.tvm.compile import resolve_target
        from lockgate.plugins.tvm.int8_matmul import activation_block, int8_isa

        isa = int8_isa(resolve_target("llvm"))
    names = {t.name for t in reader.tensors}
    types = {t.name: t.tensor_type for t in reader.tensors}
    unquantized = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)

    def weight(name: str) -> np.ndarray:
        return read_tensor(reader, name)

    def f16(values: np.ndarray) -> np.ndarray:
        # lockgate's CPU attention takes Q, K and V in float16 and gives
        # float16: modelled where the 8-bit rounding follows it
        return _f16(values) if int8 else values

    def matmul(h: np.ndarray, name: str) -> np.ndarray:
        w = weight(name)
        # the kernels take panels of 16 outputs (the tensors of a fused
        # module together: the tiny models' Q, K and V are each whole panels)
        if int8 and types[name] not in unquantized and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
            h = int8_activations(h, activation_block(types[name].name.lower(), isa))
        return h @ w.T

    gemma = c.architecture == "gemma3"
    embed = weight("token_embd.weight")
    head_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    x = embed[tokens] * (np.sqrt(np.float32(c.hidden_size)) if gemma else 1.0)
    n, d, r = len(tokens), c.head_dim, c.rotary_dim

    def rotation(theta: float, scale: float):
        pos = np.arange(n)[:, None] * scale
        inv_freq = theta ** (-np.arange(0, r, 2) / r)
        if c.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(c.rope_freq_factors)
        return np.cos(pos * inv_freq)[:, None], np.sin(pos * inv_freq)[:, None]

    local = _local_layers(c)

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    def rope(v, cos, sin):  # (n, heads, d)
        out = v.copy()
        if c.architecture in INTERLEAVED_ROPE:
            even, odd = v[..., 0:r:2], v[..., 1:r:2]
            out[..., 0:r:2] = even * cos - odd * sin
            out[..., 1:r:2] = even * sin + odd * cos
        else:
            first, second = v[..., : r // 2], v[..., r // 2 : r]
            out[..., : r // 2] = first * cos - second * sin
            out[..., r // 2 : r] = first * sin + second * cos
        return out

    def project(h, p: str, part: str, heads: int):
        y = matmul(h, f"{p}attn_{part}.weight")
        if f"{p}attn_{part}.bias" in names:
            y = y + weight(f"{p}attn_{part}.bias")
        y = y.reshape(n, heads, d)
        if f"{p}attn_{part}_norm.weight" in names:
            y = rms(y, weight(f"{p}attn_{part}_norm.weight"))
        return y

    causal = np.triu(np.full((n, n), -np.inf), 1)
    # a local layer's query i sees keys i - window + 1 .. i
    windowed = causal + np.tril(np.full((n, n), -np.inf), -c.sliding_window) if c.sliding_window else causal
    group = c.num_heads // c.num_kv_heads
    per_head = c.hidden_size // c.num_heads if gemma and c.num_layers == 62 else d
    for i in range(c.num_layers):
        p = f"blk.{i}."
        theta, scale = c.rope_theta, c.rope_scale
        if local[i]:
            theta, scale = c.rope_local_theta or 10000.0, 1.0
        cos, sin = rotation(theta, scale)
        h = rms(x, weight(p + "attn_norm.weight"))
        q = rope(f16(project(h, p, "q", c.num_heads)), cos, sin)
        k = rope(f16(project(h, p, "k", c.num_kv_heads)), cos, sin)
        v = f16(project(h, p, "v", c.num_kv_heads))
        if int8:  # as lockgate's float16 KV cache holds them
            k, v = _f16(k), _f16(v)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(per_head) + (windowed if local[i] else causal)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = matmul(f16(np.einsum("hqk,khd->qhd", probs, v)).reshape(n, -1), p + "attn_output.weight")
        if gemma:
            attn = rms(attn, weight(p + "post_attention_norm.weight"))
        x = x + attn
        h = rms(x, weight(p + "ffn_norm.weight"))
        gate = matmul(h, p + "ffn_gate.weight")
        up = matmul(h, p + "ffn_up.weight")
        if gemma:  # GELU, tanh-approximated
            activated = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            activated = gate / (1 + np.exp(-gate))
        mlp = matmul(activated * up, p + "ffn_down.weight")
        if gemma:
            mlp = rms(mlp, weight(p + "post_ffw_norm.weight"))
        x = x + mlp
    final = rms(x, weight("output_norm.weight"))
    if hidden:
        return final
    logits = matmul(final, head_name)
    if c.final_logit_softcap:
        logits = np.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
    return logits


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float64)


def _local_layers(c: ModelConfig) -> list[bool]:
    """Which layers slide, as llama.cpp reads the pattern (every sixth
    layer global by default)."""
    if not c.sliding_window:
        return [False] * c.num_layers
    if isinstance(c.sliding_window_pattern, tuple):
        return list(c.sliding_window_pattern)
    every = 6 if c.sliding_window_pattern is None else c.sliding_window_pattern
    return [every == 0 or i % every < every - 1 for i in range(c.num_layers)]
