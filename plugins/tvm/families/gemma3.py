"""Gemma 3 (GGUF architecture `gemma3`), text models.

What differs from the shared decoder:

* embeddings are multiplied by √hidden;
* each block norms the attention's and the MLP's outputs too
  (`post_attention_norm`, `post_ffw_norm`) before adding them back, and the
  MLP is GeGLU (tanh-approximated GELU of the gate times the up projection);
* Q and K are RMS-normed per head, and attention scales by
  1/√head_dim (1/√(hidden / heads) in the 62-layer 27B, as llama.cpp has it);
* layers alternate between local ones, which attend to the last
  `sliding_window` tokens and rotate with base `rope.freq_base_swa`
  (10,000), and global ones (every sixth, unless the file says otherwise),
  which see everything and rotate with `rope.freq_base` (1,000,000) and the
  file's linear RoPE scaling;
* the logits are soft-capped where the file says so.

The converter stores the norms' weights with Gemma's +1 already added, so
they are plain RMS norms here.

How the sliding window is kept: both KV caches take a kind per layer
(`mha_sliding` for the local ones) and every layer keeps every token's keys
(pages are not freed per layer: the cache costs as much as a model of global
layers), but attention on local layers reads at most a window. The caches
apply one RoPE base to every layer, so this network rotates Q and K itself
(`RopeMode.NONE`) with each layer's base, at the query positions the cache
reports. On the CPU (`paged_attention`) each query sees the window of keys
before its own position, whoever holds them: prompts chunk freely and
share prefixes. TVM's cache (CUDA) lists only the pages of each sequence's
last `sliding_window` tokens and attends a prompt chunk's own keys without
the window's mask, so there the executor keeps prefill chunks no longer
than the window (`max_prefill_chunk`), and since a forked sequence would
see its shared part's window measured from that part's own end, it turns
prefix sharing off.
"""

from __future__ import annotations

import math

from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.decoder import MLP, Attention, DecoderForCausalLM, _qk_norm_te
from lockgate.plugins.tvm.layers import CPU, RMSNorm
from lockgate.plugins.tvm.rope import rotate_halves_te

#: every n-th layer is global when the file names no pattern (llama.cpp's default)
DEFAULT_PATTERN = 6


def local_layers(config: ModelConfig) -> list[bool]:
    """Which layers attend to a sliding window, as llama.cpp reads it."""
    if not config.sliding_window:
        return [False] * config.num_layers
    pattern = config.sliding_window_pattern
    if isinstance(pattern, tuple):
        if len(pattern) != config.num_layers:
            raise ModelLoadError(
                f"the sliding-window pattern lists {len(pattern)} layers for {config.num_layers}"
            )
        return list(pattern)
    n = DEFAULT_PATTERN if pattern is None else pattern
    return [n == 0 or i % n < n - 1 for i in range(config.num_layers)]


class Gemma3Attention(Attention):
    """Attention with per-head Q/K norms and RoPE of the layer's own base."""

    def __init__(self, config: ModelConfig, layer_id: int, cpu: CPU | None, formats: dict) -> None:
        super().__init__(config, layer_id, cpu, formats)
        local = local_layers(config)[layer_id]
        self.theta = (config.rope_local_theta or 10000.0) if local else config.rope_theta
        self.scale = 1.0 if local else config.rope_scale
        self.rotary_dim = config.rotary_dim
        per_head = config.hidden_size // config.num_heads if config.num_layers == 62 else config.head_dim
        self.sm_scale = per_head**-0.5

    def _qkv(self, x: Tensor, kv_cache: PagedKVCache, row_tile: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(
            self.qkv_proj(x, row_tile), (b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        )
        heads, kv_heads, eps = self.num_heads, self.num_kv_heads, self.q_norm.eps
        qkv = op.tensor_expr_op(
            lambda t, wq, wk: _qk_norm_te(t, wq, wk, heads, eps),
            "qk_norm",
            [qkv, self.q_norm.weight, self.k_norm.weight],
        )
        positions = kv_cache.get_query_positions(b * s)
        rotary, theta, scale = self.rotary_dim, self.theta, self.scale
        return op.tensor_expr_op(
            lambda t, p: rotate_halves_te(t, p, heads, kv_heads, rotary, theta, scale),
            "rope",
            [qkv, positions],
        )


class GeGLU(MLP):
    def activation(self, gate: Tensor) -> Tensor:
        return op.gelu(gate, approximate="tanh")


class Gemma3DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, layer_id: int, cpu: CPU | None, formats: dict) -> None:
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_id, cpu, formats)
        self.post_attention_norm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GeGLU(config, layer_id, cpu, formats)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, row_tile: int) -> Tensor:
        x = x + self.post_attention_norm(self.self_attn(self.input_layernorm(x), kv_cache, row_tile))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), row_tile))


class Gemma3ForCausalLM(DecoderForCausalLM):
    """The shared decoder with Gemma 3's blocks, scaled embeddings, logit
    soft-capping and a KV cache with sliding-window layers."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, target, formats: dict | None = None) -> None:
        if not config.qk_norm:
            raise ModelLoadError("a gemma3 GGUF file carries per-head Q/K norms (blk.N.attn_q_norm.weight); this one has none")
        if config.rope_freq_factors is not None:
            raise ModelLoadError("per-frequency RoPE factors are not supported for gemma3")
        super().__init__(config, target, formats)

    @classmethod
    def max_prefill_chunk(cls, config: ModelConfig, target_kind: str = "cuda") -> int | None:
        # TVM's cache attends a chunk's own keys without the window's mask;
        # the CPU's masks every key by its position
        return None if target_kind == "llvm" else config.sliding_window or None

    @classmethod
    def shares_prefixes(cls, config: ModelConfig, target_kind: str = "cuda") -> bool:
        # in TVM's cache a fork's shared part would be windowed from its own end
        return target_kind == "llvm" or not any(local_layers(config))

    def embed(self, input_ids: Tensor) -> Tensor:
        rows = super().embed(input_ids)
        factor = math.sqrt(self.config.hidden_size)
        return op.tensor_expr_op(
            lambda t: te.compute(t.shape, lambda *i: t[i] * tirx.const(factor, t.dtype), name="scale_embeddings"),
            "scale_embeddings",
            [rows],
        )

    def final_logits(self, hidden: Tensor, row_tile: int) -> Tensor:
        logits = super().final_logits(hidden, row_tile)
        cap = self.config.final_logit_softcap
        if not cap:
            return logits
        return op.tensor_expr_op(
            lambda t: te.compute(
                t.shape,
                lambda *i: tirx.tanh(t[i] / tirx.const(cap, "float32")) * tirx.const(cap, "float32"),
                name="softcap",
            ),
            "softcap",
            [logits],
        )

    def kv_cache_options(self) -> dict:
        c = self.config
        return {
            "attn_kind": ["mha_sliding" if local else "mha" for local in local_layers(c)],
            "layer_sliding_window_size": c.sliding_window or 1024,
            # each layer's RoPE is applied in the model
            "rope_mode": RopeMode.NONE,
            "rope_scale": 1,
            "rope_scaling": {},
            "rope_ext_factors": rx.prim_value(0),
        }
