"""benchmarks/gpu_check.sh cannot rot: its random-weight GGUF writer
(benchmarks/random_gguf.py) writes files lockgate's loader reads and whose
quantized blocks decode to the weights intended, the torch encoders (used on
the GPU host) write the same bytes as gguf-py, and the whole script runs end
to end on the CPU in its smoke mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

from paths import BENCHMARKS, ROOT  # noqa: E402

sys.path.insert(0, str(BENCHMARKS))

import random_gguf  # noqa: E402
from tiny_model import NumpyWeights  # noqa: E402

from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.models.gguf_metadata import GGUFMetadata  # noqa: E402
from lockgate.models.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

#: a small shape unlike the tiny one: GQA 4:1, a vocabulary padded with placeholders, untied head
SHAPE = random_gguf.Shape(
    "test",
    {
        "num_layers": 2,
        "hidden_size": 128,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 256,
        "context_length": 4096,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    1000,
)


def decode_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 by its layout, independently of gguf-py: per 18-byte block a
    float16 d, then 16 bytes whose low nibbles are values 0-15 and high
    nibbles values 16-31, each d * (q - 8)."""
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return d * (q - 8)


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q4_0", "Q8_0"])
def test_random_gguf_is_a_model_lockgate_reads(tmp_path, tensor_type):
    path = random_gguf.write_random_gguf(tmp_path / "m.gguf", SHAPE, tensor_type, seed=5, backend="numpy")
    assert not (tmp_path / "m.gguf.partial").exists()
    metadata = GGUFMetadata(path)
    config = ModelConfig.from_gguf(metadata)
    c = SHAPE.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        c["num_layers"], c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
    )
    assert (config.intermediate_size, config.vocab_size, config.rope_theta, config.context_length) == (
        c["intermediate_size"], SHAPE.vocab_size, c["rope_theta"], c["context_length"]
    )
    assert config.tie_word_embeddings is False
    tokenizer = load_tokenizer(metadata)
    assert len(tokenizer) == SHAPE.vocab_size
    assert tokenizer.decode(tokenizer.encode("the cat sat", add_special_tokens=False)) == "the cat sat"

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(tensors) == 2 + c["num_layers"] * 9 + 1
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType[tensor_type]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32

    # the embedding is the first tensor drawn: the same seed draws it again
    intended = NumpyWeights(5).embedding(SHAPE.vocab_size, c["hidden_size"])
    embd = tensors["token_embd.weight"]
    decoded = gguf.quants.dequantize(embd.data, embd.tensor_type).reshape(intended.shape)
    if tensor_type == "F32":
        np.testing.assert_array_equal(decoded, intended)
    elif tensor_type == "F16":
        np.testing.assert_array_equal(decoded, intended.astype(np.float16).astype(np.float32))
    else:
        # within one quantization step of its block (|d| = max |x| / 8 or / 127)
        steps = {"Q4_0": 8, "Q8_0": 127}[tensor_type]
        step = np.abs(intended.reshape(-1, 32)).max(axis=1, keepdims=True) / steps
        assert np.all(np.abs(decoded.reshape(-1, 32) - intended.reshape(-1, 32)) <= step * 1.001 + 1e-6)
    if tensor_type == "Q4_0":
        np.testing.assert_array_equal(decode_q4_0(np.asarray(embd.data)).reshape(intended.shape), decoded)


def test_shapes_are_the_real_models():
    # parameter counts of meta-llama/Llama-3.2-1B (tied) and SmolLM2-135M
    assert round(random_gguf.SHAPES["llama-3.2-1b"].parameters() / 1e6) == 1236
    assert round(random_gguf.SHAPES["smollm2-135m"].parameters() / 1e6) == 135


def test_torch_encoders_write_gguf_py_bytes(tmp_path):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = 1.0  # ties for the largest magnitude
    w[2, :32] = np.linspace(-1, 1, 32)
    for encode, qtype in (
        (random_gguf.quantize_q4_0, gguf.GGMLQuantizationType.Q4_0),
        (random_gguf.quantize_q8_0, gguf.GGMLQuantizationType.Q8_0),
    ):
        np.testing.assert_array_equal(encode(torch.from_numpy(w)).numpy(), gguf.quants.quantize(w, qtype))

    weights = random_gguf.TorchWeights(seed=1, device="cpu")
    q = weights.linear(32, 16)
    from tiny_model import permute_for_llama_cpp

    np.testing.assert_array_equal(weights.permute(q, 4).numpy(), permute_for_llama_cpp(q.numpy(), 4))
    path = random_gguf.write_random_gguf(tmp_path / "t.gguf", SHAPE, "Q4_0", backend="torch-cpu")
    assert ModelConfig.from_gguf(GGUFMetadata(path)).vocab_size == SHAPE.vocab_size


def test_gpu_check_smoke_run(tmp_path):
    """The whole script on the CPU with tiny shapes: every stage runs to its
    end and every figure prints, measured or skipped for its time; nothing
    fails. The caps are generous here, so a stage stopped at one is a fault
    (a hang, a stage that never ends), not a loaded machine."""
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable,
           "GPU_CHECK_CAPS": "300 300 300 300 300 300", "GPU_CHECK_BUDGET": "1900"}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=2000,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Traceback" not in out + done.stderr, out + done.stderr
    assert "exit status" not in out, out
    assert "stopped at its cap" not in out, out
    # the output by stage: its header line, then what it printed
    blocks = re.findall(r"^== ([^\n]*?) \(cap \d+ s; \d+ s elapsed\)\n(.*?)(?=^== )", out, re.M | re.S)
    assert [name for name, _ in blocks] == [
        "random-weight models", "executor tiny F16", "executor tiny Q4_0",
        "executor tiny F16",  # the small model's sweep: in smoke mode the same tiny F16 file
        "served tiny F16, load.py", "HF transformers eager, bf16",
    ], out
    stages = dict(blocks)
    for name in ("tiny F16", "tiny Q4_0"):
        block = stages[f"executor {name}"]
        for figure in ("prefill 64-token chunks", "decode batch 1", "decode batch 4", "decode batch 16"):
            assert re.search(rf"^{name}: {figure}: (\d+\.\d tok/s total|\d+\.\d tok/s|skipped)", block, re.M), (
                name, figure, out)
    served = stages["served tiny F16, load.py"]
    assert re.findall(r"^lockgate +(\d+) +4 ", served, re.M) == ["1", "4"], out
    assert re.search(r"^HF transformers", stages["HF transformers eager, bf16"], re.M), out
    assert re.search(r"^== total elapsed: \d+ s", out, re.M), out


def test_gpu_check_skips_what_the_budget_no_longer_fits(tmp_path):
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "GPU_CHECK_BUDGET": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    skipped = re.findall(r"^== (.+): skipped, -?\d+ s of the 1 s budget left$", out, re.M)
    assert skipped == [
        "random-weight models", "HF transformers eager, bf16",
    ], out
    # no model was written, so the stages that need one say so
    assert len(re.findall(r"^== (executor|served) .*: skipped, .* was not written$", out, re.M)) == 4, out
    assert re.search(r"^== total elapsed: \d+ s \(budget 1 s\)$", out, re.M), out
