"""Cross-compile for CUDA (sm_90) on a machine without a GPU.

The library keeps CUDA C source for every kernel, compiled at load time on a
GPU host, so these check the whole CUDA pipeline (dlight GPU schedules, the
KV cache's GPU kernels, CUDA graphs, host code) short of running it, from
the generated source. They need no CUDA toolkit: nvcc is never run here.

The Llama-3.2-1B-shape tests compile from the config alone (no weights), in
float16 and with a mix of every packed format, and check what the issue asks of the CUDA
path: weights arrive as half or packed integers, every matmul is scheduled
by a matmul rule (GEMV for batch-1 decode, LowBatchGEMV for batched decode,
Matmul for prefill), prefill matmuls tile through shared memory, no kernel
is left to `dl.gpu.Fallback`, and both decode functions are CUDA graphs.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import gguf
import pytest


from tiny_model import write_tiny_gguf  # noqa: E402

from lockgate.models.config import ModelConfig  # noqa: E402

SM90 = {"kind": "cuda", "arch": "sm_90"}

LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    context_length=131072,
    tie_word_embeddings=True,
)

LLAMA_3_1_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    context_length=131072,
    tie_word_embeddings=False,
)

_MATMUL_RULES = {"GEMV", "LowBatchGEMV", "Matmul(SIMT)", "Matmul(tensor cores)"}


def _q4_formats(config: ModelConfig) -> dict[str, str]:
    """A Q4_0 file as llama.cpp writes one: Q4_0 layers, a Q8_0 head."""
    formats = {"lm_head": "q8_0"}
    for i in range(config.num_layers):
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            formats[f"layers.{i}.{module}"] = "q4_0"
    return formats


def _mixed_formats(config: ModelConfig) -> dict[str, str]:
    """Every packed kind in one compile: Q4_K_M's Q/K in Q4_K with V in
    Q6_K (split), Q4_K gate/up, down projections alternating Q6_K and Q4_0,
    a small model's Q5_0 output projections, and a Q8_0 head."""
    formats = {"lm_head": "q8_0"}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        formats[p + "self_attn.qkv_proj"] = "q4_k,q4_k,q6_k"
        formats[p + "self_attn.o_proj"] = "q5_0"
        formats[p + "mlp.gate_up_proj"] = "q4_k"
        formats[p + "mlp.down_proj"] = "q6_k" if i % 2 else "q4_0"
    return formats


def _q4_k_m_formats(config: ModelConfig) -> dict[str, str]:
    """llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for V and down projections in
    half the layers (its "more bits" layers, roughly) and for the head."""
    formats = {"lm_head": "q6_k", "embed_tokens": "q4_k"}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        more = i % 2 == 0
        formats[p + "self_attn.qkv_proj"] = "q4_k,q4_k,q6_k" if more else "q4_k"
        formats[p + "self_attn.o_proj"] = "q4_k"
        formats[p + "mlp.gate_up_proj"] = "q4_k"
        formats[p + "mlp.down_proj"] = "q6_k" if more else "q4_k"
    return formats


WEIGHT_FORMATS = {"f16": lambda config: {}, "mixed": _mixed_formats}


def _kernels(library: pathlib.Path) -> dict[str, tuple[str, str]]:
    """Kernel name -> (parameter list, source up to the next kernel)."""
    blob = library.read_bytes().decode("latin-1")
    kernels: dict[str, tuple[str, str]] = {}
    for part in re.split(r'(?=extern "C" __global__)', blob)[1:]:
        match = re.match(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)', part)
        if match and len(part) > len(kernels.get(match.group(1), ("", ""))[1]):
            kernels[match.group(1)] = (match.group(2), part)
    return kernels


def _function_of(kernel: str, schedules: dict[str, str]) -> str:
    base = re.sub(r"_kernel\d*$", "", kernel)
    assert base in schedules, (kernel, sorted(schedules))
    return base


def _weight_bytes(config: ModelConfig, formats: dict[str, str]) -> int:
    """Bytes of the CUDA model's parameters, from their shapes and dtypes."""
    from tvm.target import Target

    from lockgate.plugins.tvm.families.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}}), formats)
    total = 0
    for _, param in model.named_parameters():
        count = 1
        for dim in param.shape:
            count *= int(dim)
        total += count * {"float16": 2, "float32": 4, "uint32": 4, "int32": 4, "int8": 1, "uint8": 1}[str(param.dtype)]
    return total


def test_cross_compile_for_sm90(tmp_path):
    from lockgate.plugins.tvm.compile import as_target, compile_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    target = as_target(SM90)
    assert target.kind.name == "cuda"
    assert target.host.kind.name == "llvm"

    messages: list[str] = []
    compiled = compile_model(config, target, tmp_path / "cache", messages.append)
    assert not compiled.cached
    assert any("compiling for cuda" in m for m in messages)

    kernels = _kernels(compiled.library)
    assert len(kernels) >= 20, kernels
    assert any("attention" in k or "attn" in k for k in kernels), kernels
    assert any("matmul" in k for k in kernels), kernels

    # The GPU keeps (out, in) weights in float16, norms in float32.
    shapes = dict(compiled.params)
    assert shapes["layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 * 2) * 16, 64)
    assert shapes["lm_head.weight"] == (299, 64)
    assert compiled.dtypes["layers.0.self_attn.qkv_proj.weight"] == "float16"
    assert compiled.dtypes["norm.weight"] == "float32"

    again = compile_model(config, target, tmp_path / "cache")
    assert again.cached and again.library == compiled.library
    assert again.schedules == compiled.schedules and again.dtypes == compiled.dtypes


def test_tensorize_probe_tells_the_truth():
    """`tensorize_works` is false exactly when tensorization crashes: its
    cause, TVM IR failing to serialize to JSON, is tried here directly."""
    from lockgate.plugins.tvm.schedules import tensorize_works

    probe = "import tvm; tvm.ir.save_json(tvm.ir.PrimType('int32'))"
    serializes = subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
    assert tensorize_works() == serializes


@pytest.fixture(scope="module")
def cache_1b(tmp_path_factory):
    return tmp_path_factory.mktemp("cache-1b")


@pytest.mark.parametrize("weights", sorted(WEIGHT_FORMATS))
def test_llama_1b_shape_for_sm90(weights, cache_1b):
    from lockgate.plugins.tvm.compile import as_target, compile_model
    from lockgate.plugins.tvm.schedules import tensorize_works

    formats = WEIGHT_FORMATS[weights](LLAMA_3_2_1B)
    compiled = compile_model(LLAMA_3_2_1B, as_target(SM90), cache_1b, formats=formats, max_batch=64)
    schedules = compiled.schedules

    # Every TIR function has a real rule; none is left to Fallback.
    assert schedules
    assert not [f for f, rule in schedules.items() if rule in ("Fallback", "unscheduled")], schedules
    used = set(schedules.values())
    assert {"GEMV", "LowBatchGEMV", "Reduction", "GPUInjective", "hand-written"} <= used, used

    kernels = _kernels(compiled.library)
    matmuls = {k: v for k, v in kernels.items() if "matmul" in k}
    # q/k/v, o, gate/up, down and the head, in three shapes of batch
    assert len(matmuls) >= 12, sorted(matmuls)
    prefill = 0
    for kernel, (params, source) in matmuls.items():
        rule = schedules[_function_of(kernel, schedules)]
        assert rule in _MATMUL_RULES, (kernel, rule)
        # weights arrive as half or as packed integers, never float32
        pointers = re.findall(r"(\w[\w ]*?)\*\s*__restrict__\s*(\w+)", params)
        weights_in = [
            t.strip() for t, name in pointers if re.search(r"_(weight|codes|high|scales|mins)\d*_ptr$", name)
        ]
        assert weights_in, (kernel, params)
        if weights == "f16":
            assert set(weights_in) == {"half"}, (kernel, params)
        else:
            assert set(weights_in) <= {"half", "uint", "int", "signed char", "uchar"}, (kernel, params)
            assert {"uint", "int"} & set(weights_in), (kernel, params)
        if "num_tokens" in params:
            prefill += 1
            assert rule.startswith("Matmul"), (kernel, rule)
            # shared-memory tiles of activations and weights
            assert "__shared__" in source, kernel
            # tensor cores: pyproject pins an apache-tvm-ffi whose tensorize
            # works (the compile would fall back to the SIMT branch otherwise)
            assert tensorize_works(), "Schedule.tensorize crashes with this apache-tvm-ffi: see pyproject.toml"
            assert rule == "Matmul(tensor cores)" and "wmma::mma_sync" in source, kernel
        elif "batch_size" in params:
            assert rule == "LowBatchGEMV", (kernel, rule)
        else:
            assert rule == "GEMV", (kernel, rule)
    assert prefill >= 4, sorted(matmuls)

    # Both decode functions are captured as CUDA graphs by the VM code.
    blob = compiled.library.read_bytes()
    assert b"vm.builtin.cuda_graph.run_or_capture" in blob
    assert b"fn=decode_one_cuda_graph_capture" in blob
    assert b"fn=batch_decode_cuda_graph_capture" in blob

    # The packed weights stay packed in the parameters themselves.
    dtypes = compiled.dtypes
    layer = "layers.3.mlp.gate_up_proj"
    if weights == "f16":
        assert dtypes[layer + ".weight"] == "float16"
        assert dict(compiled.params)[layer + ".weight"] == (2 * 8192, 2048)
    else:
        params = dict(compiled.params)
        assert dtypes[layer + ".codes"] == "uint32" and dtypes[layer + ".sub_scales"] == "uint8"
        assert params[layer + ".super_scales"] == (2 * 8192, 2048 // 256)
        # Q/K (Q4_K) and V (Q6_K) as two packed parts, not one widened matrix
        assert params["layers.0.self_attn.qkv_proj.part0.codes"] == ((32 + 8) * 64, 2048 // 8)
        assert params["layers.0.self_attn.qkv_proj.part1.high"] == (8 * 64, 2048 // 16)
        assert dtypes["layers.1.mlp.down_proj.sub_scales"] == "int8"  # Q6_K's
        assert dtypes["layers.0.self_attn.o_proj.high"] == "uint32"  # Q5_0's fifth bits
        assert dtypes["lm_head.codes"] == "int32" and dtypes["lm_head.scales"] == "float16"  # Q8_0's


def test_weight_memory_of_8b_and_1b_shapes():
    gib = 1 << 30
    q4_8b = _weight_bytes(LLAMA_3_1_8B, _q4_formats(LLAMA_3_1_8B))
    f16_8b = _weight_bytes(LLAMA_3_1_8B, {})
    assert q4_8b <= 6 * 10**9, q4_8b / gib
    # Q4_0: 4.5 bits a weight in the layers (3.9 GB), 8.5 in the head
    # (0.56 GB), and the untied embedding table in float16 (1.05 GB)
    assert 5.0 * gib < q4_8b < 5.3 * gib, q4_8b / gib
    assert 14.5 * gib < f16_8b < 15.5 * gib, f16_8b / gib
    # Q4_K_M as llama.cpp mixes it: a Llama-3-8B file holds 4.58 GiB; kept
    # packed, the embedding table too (it used to be widened to about 15 GB
    # plus a float32 table)
    q4_k_m_8b = _weight_bytes(LLAMA_3_1_8B, _q4_k_m_formats(LLAMA_3_1_8B))
    assert 4.4 * gib < q4_k_m_8b < 4.58 * gib * 1.05, q4_k_m_8b / gib
    q4_1b = _weight_bytes(LLAMA_3_2_1B, _q4_formats(LLAMA_3_2_1B))
    f16_1b = _weight_bytes(LLAMA_3_2_1B, {})
    assert 2.2 * gib < f16_1b < 2.4 * gib, f16_1b / gib
    assert q4_1b < 0.45 * f16_1b, (q4_1b / gib, f16_1b / gib)


#: a small shape of each built-in family's distinctive parts, with the
#: dimensions dlight's GPU rules expect of real models (multiples of 64)
FAMILY_SHAPES = {
    "llama3-rope-scaling": {"rope_freq_factors": [1.0] * 8 + [1.5, 2.5, 4.0, 8.0] + [8.0] * 20},
    "qwen2": {"architecture": "qwen2", "attention_bias": True},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 128},
    "gemma3": {
        "architecture": "gemma3", "qk_norm": True, "head_dim": 128, "sliding_window": 64,
        "sliding_window_pattern": 2, "rope_local_theta": 10000.0, "final_logit_softcap": 30.0,
    },
}


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_each_family_cross_compiles_for_sm90_with_named_rules(family, tmp_path):
    """Every family's kernels (bias adds, per-head norms, the RoPE kernel
    with frequency factors) get a named rule, none Fallback, in f16 and
    with packed Q4_0 weights."""
    from lockgate.plugins.tvm import builtin_families
    from lockgate.plugins.tvm.compile import as_target, compile_model

    shape = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    shape.update(FAMILY_SHAPES[family])
    path = write_tiny_gguf(tmp_path / f"{family}.gguf", tensor_type="F16", vocab_size=512, **shape)
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    network = builtin_families().for_architecture(config.architecture).network("tvm")
    for weights, formats in (("f16", {}), ("q4_0", _q4_formats(config))):
        compiled = compile_model(
            config, as_target(SM90), tmp_path / "cache", formats=formats, max_batch=8, network=network
        )
        unscheduled = [f for f, rule in compiled.schedules.items() if rule in ("Fallback", "unscheduled")]
        assert not unscheduled, (weights, compiled.schedules)
        kernels = _kernels(compiled.library)
        if config.rope_freq_factors:
            rope = [source for name, (_, source) in kernels.items() if "rope" in name]
            assert rope and all("factors" in source for source in rope), sorted(kernels)
        if config.qk_norm:
            assert "layers.0.self_attn.q_norm.weight" in dict(compiled.params)
        if config.attention_bias:
            assert compiled.dtypes["layers.0.self_attn.qkv_bias"] == "float16"
        if config.sliding_window:
            # the cache's sliding-window kernels, and RoPE done in the model
            assert any("sliding_window" in name for name in kernels), sorted(kernels)
            assert any(name.startswith("rope") or "_rope" in name for name in kernels), sorted(kernels)
