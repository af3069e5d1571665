"""Hugging Face model directories (config.json, safetensors, tokenizer.json)
served like the GGUF file of the same weights."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest


from tiny_model import write_hf_directory, write_tiny_gguf  # noqa: E402

from lockgate.errors import ModelLoadError  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.hf import llama3_rope_factors  # noqa: E402
from lockgate.models.loading import open_model  # noqa: E402
from lockgate.plugin_api.manager import get_plugin_manager  # noqa: E402

pytestmark = pytest.mark.tvm

PROMPT = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198, 45, 46]
STEPS = [265, 3, 100]

FAMILIES = {
    "llama": {},
    "qwen2": {"architecture": "qwen2", "attention_bias": True},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 32},
}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tvm-cache")


def _logits(model: str, cache: pathlib.Path, **options) -> np.ndarray:
    pm = get_plugin_manager(autoload=False)
    source = open_model(pm, model)
    from lockgate.plugins.tvm.executor import create_executor

    ex = create_executor(
        source.model_file(),
        ExecutorOptions.of(max_num_seqs=1, max_total_tokens=128, prefill_chunk_size=32, cache_dir=cache, **options),
    )
    try:
        ex.add_sequence(0)
        rows = [ex.prefill([0], [PROMPT])[0]]
        rows += [ex.decode([0], [t])[0] for t in STEPS]
        return np.stack(rows), ex.compiled.formats
    finally:
        ex.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_directory_gives_the_logits_of_the_same_gguf(family, tmp_path, compile_cache):
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="F16", tie_word_embeddings=False, **FAMILIES[family])
    directory = write_hf_directory(gguf_path, tmp_path / "hf", "F16")
    from_gguf, _ = _logits(str(gguf_path), compile_cache)
    from_directory, formats = _logits(str(directory), compile_cache)
    assert set(formats.values()) == {"f16"}
    np.testing.assert_array_equal(from_directory, from_gguf)


def test_quantize_at_load_packs_a_directory_as_it_packs_a_gguf(tmp_path, compile_cache):
    """`--quantize q8_0`: the directory's matrices are packed (not f16), and
    exactly as the same float weights in a GGUF file are."""
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="F16")
    directory = write_hf_directory(gguf_path, tmp_path / "hf", "F16")
    packed, formats = _logits(str(directory), compile_cache, quantize="q8_0")
    assert set(formats.values()) == {"q8_0"}
    same, _ = _logits(str(gguf_path), compile_cache, quantize="q8_0")
    np.testing.assert_array_equal(packed, same)
    plain, _ = _logits(str(directory), compile_cache)
    assert 0 < np.abs(packed - plain).max() < 0.1


def test_bf16_weights_run_as_f16(tmp_path, compile_cache):
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="F32")
    directory = write_hf_directory(gguf_path, tmp_path / "hf", "BF16")
    from_directory, formats = _logits(str(directory), compile_cache)
    assert set(formats.values()) == {"f16"}, "BF16 must not be widened to f32"
    from_gguf, _ = _logits(str(gguf_path), compile_cache)
    # bfloat16 keeps 8 significant bits: logits of unit scale move by ~1e-2
    np.testing.assert_allclose(from_directory, from_gguf, atol=0.05)


def test_directory_tokenizer_and_stops(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", architecture="qwen2", attention_bias=True)
    directory = write_hf_directory(gguf_path, tmp_path / "hf")
    pm = get_plugin_manager(autoload=False)
    ours, theirs = open_model(pm, str(directory)), open_model(pm, str(gguf_path))
    assert ours.config == theirs.config
    assert ours.family.name == "qwen2"
    text = "the cat is on the mat <|im_end|> again"
    assert ours.tokenizer.encode(text) == theirs.tokenizer.encode(text)
    assert ours.eos_token_ids[0] == 2 and set(ours.eos_token_ids) == set(theirs.eos_token_ids)
    messages = [{"role": "user", "content": "hi"}]
    rendered = ours.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_unknown_directories_are_refused_clearly(tmp_path):
    pm = get_plugin_manager(autoload=False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architectures \['MambaForCausalLM'\]; lockgate runs: "):
        open_model(pm, str(tmp_path))
    with pytest.raises(ModelLoadError, match="nor a model directory with a config.json"):
        open_model(pm, str(tmp_path / "nowhere"))
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf")
    directory = write_hf_directory(gguf_path, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn'"):
        open_model(pm, str(directory))


def test_llama3_rope_factors_follow_the_smoothed_frequencies():
    """Llama 3.1 8B's scaling (θ 500000, 128 features, factor 8, low 1,
    high 4, 8192 original positions), against the frequencies written the
    other way round: f' = (1 - s) f / factor + s f, s = clamp(α f − β)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    factors = np.asarray(llama3_rope_factors(scaling, 500000.0, 128))
    freq = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    alpha = 8192 / (2 * math.pi) / (4.0 - 1.0)
    beta = 1.0 / (4.0 - 1.0)
    smooth = np.clip(alpha * freq - beta, 0, 1)
    scaled = (1 - smooth) * freq / 8.0 + smooth * freq
    np.testing.assert_allclose(factors, freq / scaled, rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 8.0


def test_a_gemma3_directory_gives_the_logits_of_the_same_gguf(tmp_path, compile_cache):
    """Gemma's own names (pre/post feed-forward norms), its norms stored
    without the +1, its `layer_types`, local RoPE base and soft-cap."""
    gguf_path = write_tiny_gguf(
        tmp_path / "g.gguf", tensor_type="F16", architecture="gemma3", qk_norm=True, head_dim=32, num_layers=4,
        sliding_window=16, sliding_window_pattern=2, rope_local_theta=10000.0, rope_theta=1000000.0,
        final_logit_softcap=30.0,
    )
    directory = write_hf_directory(gguf_path, tmp_path / "hf", "F16")
    from lockgate.plugins.tvm.families.gemma3 import local_layers

    pm = get_plugin_manager(autoload=False)
    ours, theirs = open_model(pm, str(directory)).config, open_model(pm, str(gguf_path)).config
    # the directory lists each layer's kind, the file says "every second"
    assert local_layers(ours) == local_layers(theirs) == [True, False, True, False]
    assert dataclasses.replace(ours, sliding_window_pattern=None) == dataclasses.replace(
        theirs, sliding_window_pattern=None
    )
    from_gguf, _ = _logits(str(gguf_path), compile_cache)
    from_directory, _ = _logits(str(directory), compile_cache)
    np.testing.assert_array_equal(from_directory, from_gguf)
