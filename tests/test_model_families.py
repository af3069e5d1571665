"""Every built-in model family on the TVM CPU executor, against the numpy
reference of `reference_model.py` (llama.cpp's arithmetic, the file's own
tensor layout), and the families' registration and refusals."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from reference_model import reference_logits  # noqa: E402
from tiny_model import write_tiny_gguf  # noqa: E402

from lockgate.errors import ModelLoadError  # noqa: E402
from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.models.executor import ExecutorOptions, ModelFile  # noqa: E402
from lockgate.models.gguf_metadata import GGUFMetadata  # noqa: E402
from lockgate.plugin_api.manager import get_plugin_manager  # noqa: E402
from lockgate.models.loading import open_model, registered_families  # noqa: E402

PROMPT = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198, 45, 46, 47, 48, 49, 51, 52]
DECODE_TOKENS = [265, 3, 100, 290]

#: Llama 3.1's factors at this head size: low frequencies divided by 8, the
#: highest kept, a smooth band between (the shape llama.cpp's converter writes)
LLAMA3_FACTORS = [1.0, 1.0, 1.0, 1.6, 3.2, 8.0, 8.0, 8.0]

#: one tiny file per family and variant: (overrides of the tiny config)
VARIANTS = {
    "llama3-rope-scaling": {"rope_freq_factors": LLAMA3_FACTORS},
    "qwen2": {"architecture": "qwen2", "attention_bias": True, "tie_word_embeddings": False},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0},
}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("families")
    return {
        name: write_tiny_gguf(d / f"{name}.gguf", seed=11, **overrides)
        for name, overrides in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tvm-cache")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_family_matches_reference(variant, family_files, compile_cache):
    from lockgate.plugins.tvm.executor import create_executor

    path = family_files[variant]
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    options = ExecutorOptions(
        max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=compile_cache
    )
    ex = create_executor(ModelFile(path, config), options)
    try:
        expected = reference_logits(path, PROMPT + DECODE_TOKENS)
        ex.add_sequence(0)
        got = [ex.prefill([0], [PROMPT])[0]]
        for token in DECODE_TOKENS[:-1]:
            got.append(ex.decode([0], [token])[0])
        want = expected[len(PROMPT) - 1 : len(PROMPT) + len(DECODE_TOKENS) - 1]
        # float32 sums and the float16 KV cache, as in test_tvm_executor
        np.testing.assert_allclose(np.stack(got), want, atol=2e-3, rtol=1e-3)
        assert np.std(want) > 0.5, "the tiny model's logits should not be flat"
    finally:
        ex.close()


def test_rope_factors_change_the_logits(family_files, tmp_path):
    """The factors are not ignored: the same weights without them give other
    logits (the reference, and so the executor above, tell them apart)."""
    plain = write_tiny_gguf(tmp_path / "plain.gguf", seed=11)
    prompt = (PROMPT * 4)[:64]
    a = reference_logits(family_files["llama3-rope-scaling"], prompt)
    b = reference_logits(plain, prompt)
    assert np.abs(a - b).max() > 0.1


def test_config_reads_each_family(family_files):
    configs = {name: ModelConfig.from_gguf(GGUFMetadata(path)) for name, path in family_files.items()}
    assert configs["qwen2"].architecture == "qwen2" and configs["qwen2"].attention_bias
    assert not configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32
    assert configs["qwen3"].head_dim * configs["qwen3"].num_heads != configs["qwen3"].hidden_size
    assert configs["llama3-rope-scaling"].rope_freq_factors == pytest.approx(LLAMA3_FACTORS)


def test_builtin_families_are_registered():
    families = registered_families(get_plugin_manager(autoload=False))
    assert families.architectures == ["llama", "qwen2", "qwen3"]
    assert families.for_architecture("llama").permuted_qk
    assert not families.for_architecture("qwen2").permuted_qk


def test_an_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="mamba")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'; lockgate runs: llama, qwen2, qwen3"):
        open_model(get_plugin_manager(autoload=False), str(path))


def test_a_plugin_adds_a_family(tmp_path):
    """A third-party family claims an architecture through the hook, and
    its network is what the executor is handed."""
    from lockgate.models.families import ModelFamily
    from lockgate.plugin_api.hookspecs import hookimpl

    class StarcoderPlugin:
        @hookimpl
        def lockgate_register_model_families(self, register):
            register(ModelFamily("mine", ("mamba",), networks={"tvm": "builtins:object"}))

    pm = get_plugin_manager(autoload=False, plugins=[StarcoderPlugin()])
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="mamba")
    source = open_model(pm, str(path))
    assert source.family.name == "mine"
    assert source.model_file().family.network("tvm") is object
    with pytest.raises(ModelLoadError, match="no network for the 'cuda-only' executor"):
        source.family.network("cuda-only")


def test_a_qwen2_file_without_biases_is_refused(tmp_path, compile_cache):
    from lockgate.plugins.tvm.executor import create_executor

    path = write_tiny_gguf(tmp_path / "q.gguf", architecture="qwen2")
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    with pytest.raises(ModelLoadError, match="Q/K/V biases"):
        create_executor(ModelFile(path, config), ExecutorOptions(cache_dir=compile_cache))
