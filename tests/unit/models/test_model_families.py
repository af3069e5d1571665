"""Every built-in model family on the TVM CPU executor, against the numpy
reference of `reference_model.py` (llama.cpp's arithmetic, the file's own
tensor layout), and the families' registration and refusals."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest


from reference_model import reference_logits  # noqa: E402
from tiny_model import FAMILY_VARIANTS as VARIANTS, LLAMA3_FACTORS, write_tiny_gguf  # noqa: E402

from lockgate.engine import EngineOptions  # noqa: E402
from lockgate.errors import ModelLoadError  # noqa: E402
from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.model_file import ModelFile  # noqa: E402
from lockgate.models.gguf_metadata import GGUFMetadata  # noqa: E402
from lockgate.plugin_api.manager import get_plugin_manager  # noqa: E402
from lockgate.models.loading import open_model, registered_families  # noqa: E402

pytestmark = pytest.mark.tvm

PROMPT = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198, 45, 46, 47, 48, 49, 51, 52]
DECODE_TOKENS = [265, 3, 100, 290]

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
    options = ExecutorOptions.of(
        max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=compile_cache
    )
    ex = create_executor(ModelFile(path, config), options)
    try:
        expected = reference_logits(path, PROMPT + DECODE_TOKENS)
        ex.add_sequence(0)
        step = ex.prefill_chunk_size  # 16 for gemma3, its window
        for start in range(0, len(PROMPT), step):
            last = ex.prefill([0], [PROMPT[start : start + step]])[0]
        got = [last]
        for token in DECODE_TOKENS[:-1]:
            got.append(ex.decode([0], [token])[0])
        want = expected[len(PROMPT) - 1 : len(PROMPT) + len(DECODE_TOKENS) - 1]
        # float32 sums and the float16 KV cache, as in test_tvm_executor;
        # a prompt prefilled in chunks (gemma3's, cut at its window) merges
        # partial attention in float16 too: up to 2.8e-3 was seen
        tolerance = 2e-3 if len(PROMPT) <= ex.prefill_chunk_size else 4e-3
        np.testing.assert_allclose(np.stack(got), want, atol=tolerance, rtol=1e-3)
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


def test_the_window_changes_the_logits(family_files, tmp_path):
    """Gemma 3's local layers see 16 tokens: with the window as wide as the
    context, the same weights give other logits past the 16th token and the
    same before it (the reference, and so the executor, tell them apart)."""
    wide = write_tiny_gguf(tmp_path / "wide.gguf", seed=11, **dict(VARIANTS["gemma3"], sliding_window=512))
    a = reference_logits(family_files["gemma3"], PROMPT)
    b = reference_logits(wide, PROMPT)
    np.testing.assert_allclose(a[:16], b[:16], atol=1e-9)
    assert np.abs(a[16:] - b[16:]).max() > 0.05


def test_config_reads_each_family(family_files):
    configs = {name: ModelConfig.from_gguf(GGUFMetadata(path)) for name, path in family_files.items()}
    assert configs["qwen2"].architecture == "qwen2" and configs["qwen2"].attention_bias
    assert not configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32
    assert configs["qwen3"].head_dim * configs["qwen3"].num_heads != configs["qwen3"].hidden_size
    assert configs["llama3-rope-scaling"].rope_freq_factors == pytest.approx(LLAMA3_FACTORS)
    gemma = configs["gemma3"]
    assert (gemma.sliding_window, gemma.sliding_window_pattern, gemma.rope_local_theta) == (16, 2, 10000.0)
    assert gemma.final_logit_softcap == 30.0


def test_builtin_families_are_registered():
    families = registered_families(get_plugin_manager(autoload=False))
    assert families.architectures == ["gemma3", "llama", "qwen2", "qwen3"]
    assert families.for_architecture("llama").permuted_qk
    assert not families.for_architecture("qwen2").permuted_qk


def test_an_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="mamba")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'; lockgate runs: gemma3, llama, qwen2, qwen3"):
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
        create_executor(ModelFile(path, config), ExecutorOptions.of(cache_dir=compile_cache))


@pytest.mark.parametrize("variant", ["llama", *sorted(VARIANTS)])
def test_truncate_equals_never_appending(variant, family_files, tiny_gguf, compile_cache):
    """Tokens appended and then truncated away leave the sequence as if they
    had never been: what comes after them, prefilled or decoded, is the same
    bits; a cut inside a page another sequence shares leaves that sequence
    as it was; every page comes back."""
    from lockgate.plugins.tvm.executor import create_executor

    path = tiny_gguf if variant == "llama" else family_files[variant]
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    options = ExecutorOptions.of(max_num_seqs=4, max_total_tokens=256, prefill_chunk_size=64, cache_dir=compile_cache)
    ex = create_executor(ModelFile(path, config), options)
    try:
        drafts, after = [5, 6, 7, 8] * 4, [9, 10]
        ex.add_sequence(1)
        ex.prefill([1], [PROMPT + drafts])
        assert len(PROMPT) == 19
        ex.fork_sequence(1, 3, 32)  # shares the full page the cut below falls in
        ex.truncate(1, len(PROMPT))
        got = [ex.prefill([1], [after])[0], ex.decode([1], [4])[0]]
        ex.add_sequence(2)
        want = [ex.prefill([2], [PROMPT + after])[0], ex.decode([2], [4])[0]]
        np.testing.assert_array_equal(np.stack(got), np.stack(want))
        # the fork still holds its prefix, drafts included
        ex.add_sequence(4)
        ex.prefill([4], [PROMPT + drafts[:13]])
        np.testing.assert_array_equal(ex.decode([3], [11])[0], ex.decode([4], [11])[0])
        with pytest.raises(ValueError, match="cannot truncate"):
            ex.truncate(2, 100)
        for seq in (1, 2, 3, 4):
            ex.remove_sequence(seq)
        assert ex.free_pages() == ex.total_pages
    finally:
        ex.close()


def test_a_sliding_window_model_shares_prefixes_on_the_cpu(family_files, compile_cache):
    """Gemma 3's local layers mask each key by its position, whoever holds
    it: on the CPU its prompts chunk freely, its sequences fork, and a
    prefix read from a fork answers as the prompt computed whole (a window
    of 16 here, so every prompt below crosses it)."""
    import numpy as np

    from lockgate.models.loading import load_model

    model = load_model(
        get_plugin_manager(autoload=False),
        str(family_files["gemma3"]),
        executor_options=ExecutorOptions.of(max_num_seqs=2, max_total_tokens=256, cache_dir=compile_cache),
        engine_options=EngineOptions(),
    )
    try:
        ex = model.executor
        assert ex.shares_prefixes and ex.prefill_chunk_size > 16
        assert model.engine.scheduler.cache is not None and model.engine.max_n > 1
        prompt = list(range(3, 43))
        ex.add_sequence(1)
        whole = ex.prefill([1], [prompt])[0]
        ex.fork_sequence(1, 2, 29)
        forked = ex.prefill([2], [prompt[29:]])[0]
        np.testing.assert_array_equal(forked, whole)
        ex.remove_sequence(2)
        ex.add_sequence(3)
        ex.prefill([3], [prompt[:20]])
        np.testing.assert_array_equal(ex.prefill([3], [prompt[20:]])[0], whole)
        for seq in (1, 3):
            ex.remove_sequence(seq)
    finally:
        model.close()
