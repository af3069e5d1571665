"""The decoder every built-in family shares: pre-norm attention over a
paged KV cache with fused Q/K/V, a gated MLP, and a tied or separate LM
head.

The KV cache is lockgate's own on the CPU (`paged_attention.CPUPagedKV`:
pools the executor owns, passed in with each step's page tables) and TVM's
`PagedKVCache` on CUDA; the attention layers call both alike.

What differs between the Llama-shaped families is read from the config:
Q/K/V biases (Qwen2), per-head Q/K RMS norms (Qwen3), RoPE scaling (Llama
3.1's per-frequency factors, linear scaling), the rotated share of each
head. A family whose block differs more (Gemma 3) subclasses the parts.

The q/k/v and gate/up projections are fused into one weight each. With
tied embeddings a single head matrix serves as both the LM head and,
gathered column-wise, the token embedding.
"""

from __future__ import annotations


import math

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from lockgate.models.config import ModelConfig
from lockgate.plugins.tvm.layers import (
    CPU,
    CPU_KV_DTYPE,
    DECODE_ROW_TILE,
    DTYPE,
    GPU_DTYPE,
    Embedding,
    PREFILL_ROW_TILE,
    RMSNorm,
    linear,
)
from lockgate.plugins.tvm.paged_attention import PAGE_SIZE, CPUPagedKV, exp2_approx
from lockgate.plugins.tvm.rope import rope_kernel


def _qk_norm_te(qkv: te.Tensor, wq: te.Tensor, wk: te.Tensor, q_heads: int, eps: float) -> te.Tensor:
    """Per-head RMS norm of the Q heads (weight `wq`) and the K heads
    (`wk`) of fused (b, s, heads, d) Q/K/V, V heads passed through, in one
    kernel: splitting Q, K and V apart and joining them again would cost
    two copies, and CUDA's schedule rules take neither a split nor a concat.
    """
    b, s, heads, d = qkv.shape
    d, kv_heads = int(d), (int(heads) - q_heads) // 2
    k = te.reduce_axis((0, d), name="k")
    squares = te.compute(
        (b, s, heads),
        lambda i, j, h: te.sum(qkv[i, j, h, k].astype("float32") * qkv[i, j, h, k].astype("float32"), axis=k),
        name="qk_norm_squares",
    )

    def normed(i, j, h, f):
        x = qkv[i, j, h, f].astype("float32")
        scale = tirx.rsqrt(squares[i, j, h] / tirx.const(float(d), "float32") + tirx.const(eps, "float32"))
        weight = tirx.Select(h < q_heads, wq[f], wk[f])
        out = tirx.Select(h < q_heads + kv_heads, x * scale * weight, x)
        return out.astype(qkv.dtype)

    return te.compute(qkv.shape, normed, name="qk_norm")


#: log2(e): exp(x) = 2**(x log2 e)
_LOG2E = math.log2(math.e)


class Attention(nn.Module):
    """Self-attention: fused Q/K/V projection (plus bias), optional per-head
    Q/K norms, RoPE and attention in the KV cache, output projection."""

    def __init__(self, config: ModelConfig, layer_id: int, cpu: CPU | None, formats: dict) -> None:
        self.layer_id = layer_id
        self.act_dtype = DTYPE if cpu else GPU_DTYPE
        self.kv_dtype = CPU_KV_DTYPE if cpu else GPU_DTYPE
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        p = f"layers.{layer_id}.self_attn."
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = linear(
            config.hidden_size, qkv_out, cpu, formats.get(p + "qkv_proj", "f32"), (q_out, kv_out, kv_out)
        )
        if config.attention_bias:
            self.qkv_bias = nn.Parameter((qkv_out,), self.act_dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_proj = linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            cpu,
            formats.get(p + "o_proj", "f32"),
        )
        self.sm_scale = config.head_dim**-0.5

    def _qkv(self, x: Tensor, kv_cache: PagedKVCache, row_tile: int) -> Tensor:
        b, s, _ = x.shape
        qkv = self.qkv_proj(x, row_tile)
        if hasattr(self, "qkv_bias"):
            qkv = qkv + self.qkv_bias
        qkv = op.reshape(qkv, (b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim))
        if hasattr(self, "q_norm"):
            heads, eps = self.num_heads, self.q_norm.eps
            qkv = op.tensor_expr_op(
                lambda x, wq, wk: _qk_norm_te(x, wq, wk, heads, eps),
                "qk_norm",
                [qkv, self.q_norm.weight, self.k_norm.weight],
            )
        return qkv

    def forward(self, x: Tensor, kv_cache: PagedKVCache | CPUPagedKV, row_tile: int) -> Tensor:
        b, s, _ = x.shape
        qkv = self._qkv(x, kv_cache, row_tile)
        # lockgate's cache takes the activations and stores float16 itself;
        # TVM's takes and gives its own dtype
        cast = self.kv_dtype != self.act_dtype and not isinstance(kv_cache, CPUPagedKV)
        if cast:
            qkv = qkv.astype(self.kv_dtype)
        out = kv_cache.attention_with_fused_qkv(
            self.layer_id, qkv, self.num_heads, sm_scale=self.sm_scale
        )
        if cast:
            out = out.astype(self.act_dtype)
        return self.o_proj(op.reshape(out, (b, s, self.num_heads * self.head_dim)), row_tile)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused; SwiGLU by default."""

    def __init__(self, config: ModelConfig, layer_id: int, cpu: CPU | None, formats: dict) -> None:
        p = f"layers.{layer_id}.mlp."
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = linear(
            config.hidden_size,
            2 * config.intermediate_size,
            cpu,
            formats.get(p + "gate_up_proj", "f32"),
            (config.intermediate_size, config.intermediate_size),
        )
        self.down_proj = linear(
            config.intermediate_size, config.hidden_size, cpu, formats.get(p + "down_proj", "f32")
        )
        self.cpu = cpu is not None

    def activation(self, gate: Tensor) -> Tensor:
        """SiLU; on the CPU with `kernels.exp2_approx`, which vectorizes
        where `exp` is a libm call per element (a 256-token default-model
        prefill spent 7 % of its time in the kernel of SiLU and the product)."""
        if not self.cpu:
            return op.silu(gate)
        return op.tensor_expr_op(
            lambda g: te.compute(
                g.shape,
                lambda *i: g(*i) / (tirx.const(1.0, g.dtype) + exp2_approx(-g(*i) * tirx.const(_LOG2E, g.dtype))),
                name="silu",
            ),
            "silu",
            [gate],
        )

    def forward(self, x: Tensor, row_tile: int) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x, row_tile), 2, axis=-1)
        return self.down_proj(self.activation(gate) * up, row_tile)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    attention_class = Attention
    mlp_class = MLP

    def __init__(self, config: ModelConfig, layer_id: int, cpu: CPU | None, formats: dict) -> None:
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_id, cpu, formats)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_class(config, layer_id, cpu, formats)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, row_tile: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, row_tile)
        return x + self.mlp(self.post_attention_layernorm(x), row_tile)


class DecoderForCausalLM(nn.Module):
    """The exported model.

    Functions (see `export_spec`): `embed(input_ids)`, `batch_prefill(embeds,
    positions, kv)`, `batch_prefill_hidden(embeds, positions, kv)`,
    `batch_decode(embeds, kv)`, `decode_one(embeds, kv)`,
    and on CUDA `create_tir_paged_kv_cache(max_batch, max_total_len,
    prefill_chunk, page)`. `kv` is TVM's cache object on CUDA; on the CPU
    the pools and the step's page tables (`kv_inputs`), which
    `page_pool.PagePool.step` builds. A family changes a part by overriding
    `layer_class`, `embed`, `final_logits` or `kv_cache_options`.
    """

    layer_class = DecoderLayer

    @classmethod
    def max_prefill_chunk(cls, config: ModelConfig, target_kind: str = "cuda") -> int | None:
        """The most tokens one prefill call may carry for this network on
        `target_kind` ("llvm" or "cuda"; None: no limit of its own)."""
        return None

    @classmethod
    def shares_prefixes(cls, config: ModelConfig, target_kind: str = "cuda") -> bool:
        """Whether forked sequences may share KV pages on `target_kind`
        (`Executor.shares_prefixes`)."""
        return True

    def __init__(self, config: ModelConfig, target: Target, formats: dict | None = None) -> None:
        self.config = config
        self.target = target
        formats = formats or {}
        cpu = CPU.for_target(target, formats)
        self.cpu = cpu is not None
        self.act_dtype = DTYPE if cpu else GPU_DTYPE
        self.kv_dtype = CPU_KV_DTYPE if cpu else GPU_DTYPE
        if not config.tie_word_embeddings:
            self.embed_tokens = Embedding(
                config.vocab_size, config.hidden_size, formats.get("embed_tokens", "f16"), self.act_dtype
            )
        self.layers = nn.ModuleList(
            [self.layer_class(config, i, cpu, formats) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = linear(config.hidden_size, config.vocab_size, cpu, formats.get("lm_head", "f32"))

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.config.tie_word_embeddings:
            # A strided gather of a few columns of the head costs far less
            # than keeping a second copy of the matrix.
            return self.lm_head.columns(input_ids)
        return self.embed_tokens(input_ids)

    def _body(self, x: Tensor, kv_cache: PagedKVCache, row_tile: int) -> Tensor:
        for layer in self.layers:
            x = layer(x, kv_cache, row_tile)
        return x

    def final_logits(self, hidden: Tensor, row_tile: int) -> Tensor:
        """float32 logits of the final hidden states."""
        return self.lm_head(self.norm(hidden), row_tile, "float32")

    def _cache(self, kv_cache, *, prefill: bool):
        """The cache the layers call: TVM's object as it is, or on the CPU
        lockgate's over the function's inputs."""
        if not self.cpu:
            return kv_cache
        return CPUPagedKV(kv_cache, prefill=prefill, config=self.config, options=self.kv_cache_options(),
                          dtype=self.act_dtype, kv_dtype=self.kv_dtype)

    def _returned(self, logits: Tensor, kv_cache):
        # TVM's cache object is returned to the caller; lockgate's pools were updated in place
        return (logits, kv_cache) if not self.cpu else logits

    def batch_prefill(self, input_embeds: Tensor, positions: Tensor, kv_cache):
        hidden = self._body(input_embeds, self._cache(kv_cache, prefill=True), PREFILL_ROW_TILE)
        # Only the rows whose logits are wanted go through the norm and head.
        hidden = op.take(hidden, positions, axis=1)
        return self._returned(self.final_logits(hidden, 1), kv_cache)

    def batch_prefill_hidden(self, input_embeds: Tensor, positions: Tensor, kv_cache):
        """`batch_prefill`, returning the final hidden states (after the last
        norm, float32) of the rows at `positions` instead of their logits:
        what embeddings pool and a classification head scores."""
        hidden = self._body(input_embeds, self._cache(kv_cache, prefill=True), PREFILL_ROW_TILE)
        return self._returned(self.final_hidden(op.take(hidden, positions, axis=1)), kv_cache)

    def final_hidden(self, hidden: Tensor) -> Tensor:
        """float32 final hidden states: the last norm, computed in float32
        and left there (the LM head's input)."""
        if hidden.dtype != "float32":
            hidden = hidden.astype("float32")
        return op.rms_norm(hidden, self.norm.weight, axes=[-1], epsilon=self.norm.eps)

    def batch_decode(self, input_embeds: Tensor, kv_cache):
        hidden = self._body(input_embeds, self._cache(kv_cache, prefill=False), DECODE_ROW_TILE)
        return self._returned(self.final_logits(hidden, DECODE_ROW_TILE), kv_cache)

    def decode_one(self, input_embeds: Tensor, kv_cache):
        """`batch_decode` for a batch of one (or a few): untiled rows waste
        no work on padding."""
        hidden = self._body(input_embeds, self._cache(kv_cache, prefill=False), 1)
        return self._returned(self.final_logits(hidden, 1), kv_cache)

    def rope(self) -> tuple[dict, rx.Expr]:
        """The KV cache's RoPE scaling: (rope_scaling, rope_ext_factors).

        Llama 3.1's per-frequency divisors go in as the cache's extension
        factors, the same factors for short and long sequences as TVM lays
        them out, and `rope.rope_kernel` has the kernel built that
        reads them: frequency i is θ^(-2i/d) / factor[i], as llama.cpp
        computes it from `rope_freqs.weight`. The "longrope" type (no
        attention scaling: maximum length equal to the original) keeps the
        attention kernels' inline-RoPE code paths, unused here, valid.
        """
        c = self.config
        if c.rope_freq_factors is None:
            return {}, rx.prim_value(0)
        factors = np.asarray(c.rope_freq_factors * 2, dtype=np.float32)
        scaling = {
            "rope_type": "longrope",
            "max_position_embeddings": c.context_length,
            "original_max_position_embeddings": c.context_length,
        }
        return scaling, rx.const(factors)

    def kv_cache_options(self) -> dict:
        """What this network sets of its `TIRPagedKVCache` beyond the sizes
        and shapes: the attention kind of each layer and how RoPE is
        applied. A family overrides it (Gemma 3: sliding-window layers, RoPE
        in the model)."""
        rope_scaling, rope_ext_factors = self.rope()
        return {
            "attn_kind": "mha",
            "rope_mode": RopeMode.NORMAL,
            "rope_scale": self.config.rope_scale,
            "rope_scaling": rope_scaling,
            "rope_ext_factors": rope_ext_factors,
        }

    def create_tir_paged_kv_cache(
        self,
        max_batch_size,
        max_total_seq_len,
        prefill_chunk_size,
        page_size,
    ) -> PagedKVCache:
        c = self.config
        with rope_kernel(factors=c.rope_freq_factors is not None):
            return TIRPagedKVCache(
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=0,
                layer_partition=rx.ShapeExpr([0, c.num_layers]),
                num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads,
                qk_head_dim=c.head_dim,
                v_head_dim=c.head_dim,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_theta=c.rope_theta,
                rotary_dim=c.rotary_dim,
                enable_disaggregation=False,
                dtype=self.kv_dtype,
                target=self.target,
                **self.kv_cache_options(),
            )

    def export_spec(self) -> dict:
        """The `export_tvm` spec: packed parameters last, no effects;
        `batch_prefill_hidden` takes what `batch_prefill` takes."""
        spec = self._spec()
        return {**spec, "batch_prefill_hidden": dict(spec["batch_prefill"])}

    def _spec(self) -> dict:
        hidden = self.config.hidden_size
        dtype = self.act_dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        if self.cpu:
            return self._cpu_spec(hidden, dtype, packed)
        kv = nn.spec.Object(object_type=PagedKVCache)
        return {
            "embed": {
                "input_ids": nn.spec.Tensor(["num_tokens"], "int32"),
                "$": packed,
            },
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "num_tokens", hidden], dtype),
                "positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv_cache": kv,
                "$": packed,
            },
            "batch_decode": {
                "input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
                "kv_cache": kv,
                "$": packed,
            },
            # On the CPU the batch stays symbolic even here: with a static
            # batch of one, dlight's CPU reduction rule recomputes rms_norm
            # once per column. On CUDA it is static, which is what
            # `dl.gpu.GEMV` matches (and what a CUDA graph captures).
            "decode_one": {
                "input_embeds": nn.spec.Tensor(
                    ["batch_size" if self.cpu else 1, 1, hidden], dtype
                ),
                "kv_cache": kv,
                "$": packed,
            },
            "create_tir_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }

    def kv_inputs(self, *, prefill: bool) -> tuple:
        """On the CPU, what a function's `kv_cache` argument is: the key and
        value pools (`paged_attention`'s layouts), then each new token's
        position and slot, each sequence's page list (indptr, values) and,
        for a prefill, where each sequence's tokens start."""
        c = self.config
        pages = "num_pages"
        tensors = (
            nn.spec.Tensor([c.num_layers, pages, c.num_kv_heads, c.head_dim, PAGE_SIZE], self.kv_dtype),
            nn.spec.Tensor([c.num_layers, pages, c.num_kv_heads, PAGE_SIZE, c.head_dim], self.kv_dtype),
            nn.spec.Tensor(["num_tokens"], "int32"),
            nn.spec.Tensor(["num_tokens"], "int32"),
            nn.spec.Tensor(["batch_plus_one"], "int32"),
            nn.spec.Tensor(["num_listed_pages"], "int32"),
        )
        return tensors + (nn.spec.Tensor(["batch_plus_one"], "int32"),) if prefill else tensors

    def _cpu_spec(self, hidden: int, dtype: str, packed: dict) -> dict:
        return {
            "embed": {"input_ids": nn.spec.Tensor(["num_tokens"], "int32"), "$": packed},
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "num_tokens", hidden], dtype),
                "positions": nn.spec.Tensor(["num_logits"], "int32"),
                "kv_cache": self.kv_inputs(prefill=True),
                "$": packed,
            },
            # the batch stays symbolic even for one sequence: with a static
            # batch of one, dlight's CPU reduction rule recomputes rms_norm
            # once per column
            **{name: {"input_embeds": nn.spec.Tensor(["num_tokens", 1, hidden], dtype),
                      "kv_cache": self.kv_inputs(prefill=False), "$": packed}
               for name in ("batch_decode", "decode_one")},
        }
