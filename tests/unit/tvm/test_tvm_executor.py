"""The TVM executor on a tiny random model, against an independent numpy forward.

The numpy reference reads the GGUF as llama.cpp does: weights in the file's
own row order with interleaved-pair RoPE. The executor undoes the Q/K
permutation and uses rotate-half RoPE, so agreement checks that step too.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import gguf
import numpy as np
import pytest


from paths import SUPPORT  # noqa: E402
from reference_model import read_tensor as _read, reference_logits  # noqa: E402
from tiny_executor import PROMPT, make_executor  # noqa: E402
from tiny_model import write_tiny_gguf  # noqa: E402

from lockgate.errors import ModelLoadError  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.models.gguf_metadata import GGUFMetadata  # noqa: E402

DECODE_TOKENS = [265, 3, 100, 290]



# fixtures ------------------------------------------------------------------


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tvm-cache")


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("tiny")
    files = {
        t: write_tiny_gguf(d / f"tiny-{t}.gguf", tensor_type=t)
        for t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
    }
    files["untied"] = write_tiny_gguf(d / "tiny-untied.gguf", tie_word_embeddings=False, seed=3)
    return files


@pytest.fixture(scope="module")
def executor(tiny_files, compile_cache):
    ex = make_executor(tiny_files["F32"], compile_cache)
    yield ex
    ex.close()


@pytest.fixture
def seqs(executor):
    """Hands out fresh sequence ids and removes them after the test."""
    made: list[int] = []

    def new(seq_id: int | None = None) -> int:
        seq_id = max(made, default=100) + 1 if seq_id is None else seq_id
        executor.add_sequence(seq_id)
        made.append(seq_id)
        return seq_id

    yield new
    for seq_id in made:
        executor.remove_sequence(seq_id)
    assert executor.free_pages() == executor.total_pages


def greedy(executor, seq_id: int, logits: np.ndarray, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append(token)
        logits = executor.decode([seq_id], [token])[0]
    return out


# tests ---------------------------------------------------------------------


def _prompt_and_steps(ex) -> np.ndarray:
    ex.add_sequence(0)
    got = [ex.prefill([0], [PROMPT])[0]]
    for token in DECODE_TOKENS[:-1]:
        got.append(ex.decode([0], [token])[0])
    return np.stack(got)


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "untied"])
def test_logits_match_numpy_reference(kind, tiny_files, compile_cache):
    path = tiny_files[kind]
    ex = make_executor(path, compile_cache, exact_matmul=True)
    try:
        expected = reference_logits(path, PROMPT + DECODE_TOKENS)
        got = _prompt_and_steps(ex)
        want = expected[len(PROMPT) - 1 : len(PROMPT) + len(DECODE_TOKENS) - 1]
        assert got.shape == (len(DECODE_TOKENS), ex.vocab_size)
        assert got.dtype == np.float32
        # With `exact_matmul` the executor multiplies by exactly the values
        # the reference dequantizes to (`test_repacked_codes_are_bit_exact`),
        # so what is left for every weight type is float32 summation order
        # and the float16 KV cache: keys and values rounded to 11 significant
        # bits (relative 2^-11 ≈ 5e-4) move logits of unit scale by about 1e-3.
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
        assert (got.argmax(-1) == want.argmax(-1)).all()
        assert np.std(want) > 0.5, "the tiny model's logits should not be flat"
    finally:
        ex.close()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_int8_activations_match_numpy_reference(kind, tiny_files, compile_cache):
    """By default packed weights multiply 8-bit activations (`int8_matmul`):
    the logits follow a reference that rounds the activations the same way
    more closely than the exact ones. Not bit for bit: a summation order
    that moves an activation across a rounding boundary moves it by a whole
    step (1/127 of its block's largest); the kernels themselves are checked
    exactly in `test_int8_matmul.py`."""
    path = tiny_files[kind]
    ex = make_executor(path, compile_cache)
    try:
        assert "cpu_activations" not in ex.compiled.formats
        got = _prompt_and_steps(ex)
        rows = slice(len(PROMPT) - 1, len(PROMPT) + len(DECODE_TOKENS) - 1)
        rounded = reference_logits(path, PROMPT + DECODE_TOKENS, int8=True)[rows]
        exact = reference_logits(path, PROMPT + DECODE_TOKENS)[rows]
        np.testing.assert_allclose(got, rounded, atol=0.1)
        assert (got.argmax(-1) == exact.argmax(-1)).all()
        assert np.abs(got - rounded).mean() < np.abs(got - exact).mean()
    finally:
        ex.close()


def test_long_chunked_prompt_matches_reference(executor, seqs, tiny_files):
    """Several KV pages, a prefill split across calls (attention over cached
    pages merged with the new chunk) and decode steps across a page edge."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 299, 45).tolist()
    steps = rng.integers(3, 299, 6).tolist()
    expected = reference_logits(tiny_files["F32"], prompt + steps)
    s = seqs()
    executor.prefill([s], [prompt[:30]])
    got = [executor.prefill([s], [prompt[30:]])[0]]
    for token in steps[:-1]:
        got.append(executor.decode([s], [token])[0])
    want = expected[len(prompt) - 1 : len(prompt) + len(steps) - 1]
    np.testing.assert_allclose(np.stack(got), want, atol=2e-3, rtol=1e-3)


def test_executor_attributes(executor):
    assert executor.vocab_size == 299
    assert executor.page_size == 16
    assert executor.max_num_seqs == 4
    assert executor.prefill_chunk_size == 64
    assert executor.total_pages >= 1024 // 16
    assert executor.max_sequence_length == min(512, executor.total_pages * 16)
    assert executor.free_pages() == executor.total_pages


def test_ragged_prefill_and_batched_decode_equal_single(executor, seqs):
    prompts = [PROMPT, [1, 80, 81, 82, 83, 84, 85], [5]]
    alone = []
    for prompt in prompts:
        s = seqs()
        logits = executor.prefill([s], [prompt])
        tokens = greedy(executor, s, logits[0], 5)
        alone.append((logits[0], tokens))

    ids = [seqs() for _ in prompts]
    logits = executor.prefill(ids, prompts)
    for row, (want, _) in zip(logits, alone):
        np.testing.assert_allclose(row, want, atol=1e-4, rtol=1e-4)
    outs = [[] for _ in ids]
    for _ in range(5):
        tokens = [int(row.argmax()) for row in logits]
        for out, t in zip(outs, tokens):
            out.append(t)
        logits = executor.decode(ids, tokens)
    assert outs == [tokens for _, tokens in alone]


def test_mixed_prefill_with_history_equals_single(executor, seqs):
    """One prefill call carrying a continuation of a cached sequence, a
    forked child's continuation and a fresh prompt."""
    history, tail, fresh = PROMPT + [40] * 20, [5, 6, 7], [1, 80, 81]
    alone = []
    for prompt in (history + tail, history + [9, 9], fresh):
        s = seqs()
        alone.append(executor.prefill([s], [prompt])[0])

    cached, fresh_id = seqs(), seqs()
    executor.prefill([cached], [history])
    child = 4040
    executor.fork_sequence(cached, child)
    try:
        logits = executor.prefill([cached, child, fresh_id], [tail, [9, 9], fresh])
    finally:
        executor.remove_sequence(child)
    for got, want in zip(logits, alone):
        # every query attends over its whole page list in one pass: the same bits
        np.testing.assert_array_equal(got, want)


def test_chunked_prefill_equals_one_shot(executor, seqs):
    whole, split = seqs(), seqs()
    one_shot = executor.prefill([whole], [PROMPT])[0]
    executor.prefill([split], [PROMPT[:5]])
    chunked = executor.prefill([split], [PROMPT[5:]])[0]
    np.testing.assert_array_equal(chunked, one_shot)
    assert greedy(executor, split, chunked, 4) == greedy(executor, whole, one_shot, 4)


def test_fork_continues_like_parent(executor, seqs):
    parent = seqs()
    logits = executor.prefill([parent], [PROMPT + [3] * 9])[0]
    child = 777
    executor.fork_sequence(parent, child)
    try:
        token = int(logits.argmax())
        from_child = executor.decode([child], [token])[0]
        from_parent = executor.decode([parent], [token])[0]
        np.testing.assert_allclose(from_child, from_parent, atol=1e-5)
        both = executor.decode([parent, child], [7, 7])
        np.testing.assert_allclose(both[0], both[1], atol=1e-5)
    finally:
        executor.remove_sequence(child)


def test_remove_returns_pages(executor):
    total = executor.total_pages
    executor.add_sequence(5)
    executor.prefill([5], [list(range(3, 3 + 40))])
    assert executor.free_pages() == total - 3
    executor.fork_sequence(5, 6)
    executor.decode([5, 6], [4, 4])
    assert executor.free_pages() < total - 3
    executor.remove_sequence(5)
    executor.remove_sequence(6)
    assert executor.free_pages() == total


def test_caller_mistakes_raise_value_error(executor, seqs):
    s = seqs()
    with pytest.raises(ValueError, match="unknown sequence"):
        executor.prefill([999], [[1, 2]])
    with pytest.raises(ValueError, match="unknown sequence"):
        executor.decode([999], [1])
    with pytest.raises(ValueError, match="unknown sequence"):
        executor.remove_sequence(999)
    with pytest.raises(ValueError, match="at least one token"):
        executor.prefill([s], [[]])
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        executor.prefill([s], [[5] * 65])
    with pytest.raises(ValueError, match="out of range"):
        executor.prefill([s], [[5, 299]])
    with pytest.raises(ValueError, match="already exists"):
        executor.add_sequence(s)
    with pytest.raises(ValueError, match="twice"):
        executor.decode([s, s], [1, 1])
    with pytest.raises(ValueError):
        executor.decode([s], [1, 2])
    with pytest.raises(ValueError, match="holds no tokens"):
        executor.fork_sequence(s, 4242)
    others = [seqs() for _ in range(4)]
    with pytest.raises(ValueError, match="max_num_seqs"):
        executor.decode([s, *others], [1] * 5)
    assert executor.free_pages() == executor.total_pages

    reference = seqs()
    want = executor.prefill([reference], [PROMPT])[0]
    np.testing.assert_allclose(executor.prefill([s], [PROMPT])[0], want, atol=1e-5)


def test_bad_options_raise_value_error(tiny_files, compile_cache):
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_executor(tiny_files["F32"], compile_cache, max_num_seqs=0)
    with pytest.raises(ValueError, match="target"):
        make_executor(tiny_files["F32"], compile_cache, target="tpu")


def test_sequence_length_limit(tiny_files, compile_cache):
    ex = make_executor(tiny_files["F32"], compile_cache, max_total_tokens=64, prefill_chunk_size=64)
    try:
        assert ex.max_sequence_length <= ex.total_pages * ex.page_size
        ex.add_sequence(0)
        remaining = ex.max_sequence_length - 1
        while remaining:
            n = min(remaining, ex.prefill_chunk_size)
            ex.prefill([0], [[5] * n])
            remaining -= n
        ex.decode([0], [5])
        with pytest.raises(ValueError, match="limit"):
            ex.decode([0], [5])
    finally:
        ex.close()
    ex.close()


def test_full_cache_refuses_work_and_stays_usable(tiny_files, compile_cache):
    ex = make_executor(tiny_files["F32"], compile_cache, max_total_tokens=48)
    try:
        ex.add_sequence(0)
        ex.prefill([0], [list(range(3, 3 + 16 * ex.total_pages - 8))])
        assert ex.free_pages() == 0
        with pytest.raises(ValueError, match="no free KV page"):
            ex.fork_sequence(0, 1)
        ex.add_sequence(2)
        with pytest.raises(ValueError, match="KV pages needed"):
            ex.prefill([2], [[5, 6]])
        ex.decode([0], [7])
        ex.remove_sequence(0)
        assert ex.free_pages() == ex.total_pages
        ex.prefill([2], [[5, 6]])
    finally:
        ex.close()


def test_second_start_reuses_compiled_library(tiny_files, tmp_path):
    messages: list[str] = []
    first = make_executor(tiny_files["F32"], tmp_path, progress=messages.append)
    library = first.compiled.library
    assert not first.compiled.cached
    assert any("compiling" in m for m in messages)
    first.close()
    stamp = library.stat().st_mtime_ns
    libraries = sorted(tmp_path.glob("*.so"))

    messages.clear()
    second = make_executor(tiny_files["F32"], tmp_path, progress=messages.append)
    try:
        assert second.compiled.cached
        assert second.compiled.library == library
        assert library.stat().st_mtime_ns == stamp
        assert sorted(tmp_path.glob("*.so")) == libraries
        assert not any("compiling" in m for m in messages)
        assert not list(tmp_path.glob(".tmp-*"))
        second.add_sequence(1)
        assert second.prefill([1], [PROMPT]).shape == (1, 299)
    finally:
        second.close()


_RUNTIME_ONLY_START = """
import json, pathlib, sys
sys.path[:0] = {tests!r}
from tiny_executor import PROMPT, make_executor
results = []
for _ in range(2):
    ex = make_executor(pathlib.Path({model!r}), pathlib.Path({cache!r}))
    ex.add_sequence(0)
    results.append({{"cached": ex.compiled.cached, "logits": ex.prefill([0], [PROMPT])[0].tolist()}})
    ex.close()
imported = "tvm" in sys.modules
optional = sorted(name for name in ("ml_dtypes", "torch") if name in sys.modules)
import tvm
maps = open("/proc/self/maps").read()
print(json.dumps({{"runtime_only": tvm.base._RUNTIME_ONLY, "compiler": "libtvm_compiler" in maps,
                  "imported": imported, "optional": optional, "runs": results}}))
"""


def test_runtime_only_process_compiles_in_a_child_and_runs_the_cached_library(executor, tiny_files, tmp_path):
    """A serving process loads TVM's runtime library alone
    (`TVM_USE_RUNTIME_LIB=1`, as `lockgate serve` sets) and never imports
    TVM's Python package (`plugins/tvm/runtime.py`), nor the packages tvm-ffi
    would take for dtypes it never sees (ml_dtypes): a missing library is
    built in a child process, a cached one is found without the compiler,
    and either runs as here."""
    import json
    import os
    import subprocess

    script = _RUNTIME_ONLY_START.format(
        tests=[str(SUPPORT)], model=str(tiny_files["F32"]), cache=str(tmp_path)
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["runtime_only"] and not found["compiler"] and not found["imported"]
    assert found["optional"] == []
    assert [run["cached"] for run in found["runs"]] == [False, True]
    executor.add_sequence(90)
    try:
        here = executor.prefill([90], [PROMPT])[0]
    finally:
        executor.remove_sequence(90)
    for run in found["runs"]:
        np.testing.assert_array_equal(np.asarray(run["logits"], dtype=np.float32), here)


def test_weight_errors_are_model_load_errors(tiny_files):
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import iter_gguf_weights

    path = tiny_files["F32"]
    metadata = GGUFMetadata(path)
    config = ModelConfig.from_gguf(metadata)
    tensors = GGUFTensors(metadata)  # as the executor reads them

    def load(config, params):
        return list(iter_gguf_weights(tensors, config, params))

    params = [("lm_head.weight", (64, 299)), ("layers.0.input_layernorm.weight", (64,))]
    head, norm = load(config, params)
    reader = gguf.GGUFReader(path)
    np.testing.assert_array_equal(head, _read(reader, "token_embd.weight").T.astype(np.float32))
    np.testing.assert_array_equal(norm, _read(reader, "blk.0.attn_norm.weight").astype(np.float32))

    wrong = dataclasses.replace(config, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="ffn_gate"):
        load(wrong, [("layers.0.mlp.gate_up_proj.weight", (64, 192))])
    with pytest.raises(ModelLoadError, match="blk.7"):
        load(config, [("layers.7.input_layernorm.weight", (64,))])
    with pytest.raises(ModelLoadError, match="no GGUF tensor"):
        load(config, [("bogus.weight", (1,))])


def test_a_load_parses_the_gguf_header_once(tiny_gguf, compile_cache, monkeypatch):
    """The config, the tokenizer and the executor's tensor table all come
    from one parse of the header (`ModelFile.metadata`)."""
    from lockgate.models import gguf_metadata, load_model
    from lockgate.plugin_api.manager import get_plugin_manager

    parses = []
    parse = gguf_metadata._parse

    def counted(buf):
        parses.append(1)
        return parse(buf)

    monkeypatch.setattr(gguf_metadata, "_parse", counted)
    options = ExecutorOptions.of(max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=compile_cache)
    model = load_model(get_plugin_manager(autoload=False), str(tiny_gguf), executor_options=options)
    model.executor.close()
    assert len(parses) == 1


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_tensor_index_and_dequantize_match_gguf(kind, tiny_files):
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors, read_tensor_index

    path = tiny_files[kind]
    reader = gguf.GGUFReader(path)
    index = read_tensor_index(path)
    assert set(index) == {t.name for t in reader.tensors}
    # the header the loader already read gives the same table
    assert read_tensor_index(GGUFMetadata(path)).keys() == index.keys()
    ours = GGUFTensors(path)
    for t in reader.tensors:
        assert index[t.name].shape == tuple(int(d) for d in t.shape)
        assert index[t.name].tensor_type == t.tensor_type
        shape = tuple(reversed(index[t.name].shape))
        expected = _read(reader, t.name).astype(np.float32)
        np.testing.assert_array_equal(ours._read(t.name, shape), expected)


def test_not_a_gguf_file_is_a_model_load_error(tmp_path):
    from lockgate.plugins.tvm.gguf_tensors import read_tensor_index

    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_tensor_index(bogus)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_repacked_codes_are_bit_exact(kind, tiny_files):
    """Codes and scales taken from the GGUF blocks stand for exactly the
    values gguf's own dequantization gives."""
    from lockgate.plugins.tvm.formats import unpack_values
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import linear_formats

    path = tiny_files[kind]
    reader = gguf.GGUFReader(path)
    fmt = kind.lower()
    tensors = GGUFTensors(path)
    formats = linear_formats(tensors, ModelConfig.from_gguf(reader))
    assert set(formats.values()) == {fmt}
    checked = 0
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType[kind]:
            continue
        rows, cols = reversed([int(d) for d in t.shape])
        parts = tensors.quantized(t.name, rows, cols, fmt)
        assert parts["scales"].shape == (rows, cols // 32)
        expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        np.testing.assert_array_equal(unpack_values(parts, fmt), expected.reshape(rows, cols))
        checked += 1
    assert checked >= 7


def test_each_tensor_keeps_its_format(tmp_path):
    """A type no kernel reads (BF16) is widened to f16; a fused module whose
    tensors differ in type gets one format per tensor, so each stays packed;
    a separate embedding table keeps its own type."""
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import linear_formats

    path = write_tiny_gguf(tmp_path / "bf16.gguf", tensor_type="BF16")
    formats = linear_formats(GGUFTensors(path), ModelConfig.from_gguf(gguf.GGUFReader(path)))
    assert set(formats.values()) == {"f16"}

    mixed = write_tiny_gguf(
        tmp_path / "mixed.gguf",
        tensor_type="Q5_0",
        tensor_types={"attn_v.weight": "Q8_0", "blk.1.ffn_up.weight": "Q4_1", "token_embd.weight": "Q5_1"},
        tie_word_embeddings=False,
    )
    formats = linear_formats(GGUFTensors(mixed), ModelConfig.from_gguf(gguf.GGUFReader(mixed)))
    assert formats["layers.0.self_attn.qkv_proj"] == "q5_0,q5_0,q8_0"
    assert formats["layers.0.mlp.gate_up_proj"] == "q5_0"
    assert formats["layers.1.mlp.gate_up_proj"] == "q5_0,q4_1"
    assert formats["embed_tokens"] == "q5_1" and formats["lm_head"] == "q5_0"


def test_padded_decode_equals_unpadded(tiny_files, compile_cache):
    """CUDA pads decode batches to buckets with the executor's own padding
    sequences (one graph capture per bucket) and sends batches past the
    buckets through the prefill function; forced on here on the CPU, both
    give the logits of a plain batched decode and leave no page behind."""
    ex = make_executor(tiny_files["F16"], compile_cache, max_num_seqs=8)
    try:
        prompts = [PROMPT, [1, 80, 81, 82, 83, 84, 85], [5]]
        results = []
        pages = ex._kv.free_pages()
        for buckets in ((), (4, 8), (2,)):
            ex._set_decode_buckets(buckets)
            ids = [len(results) * 10 + i for i in range(len(prompts))]
            for s in ids:
                ex.add_sequence(s)
            logits = ex.prefill(ids, prompts)
            steps = []
            for _ in range(3):
                logits = ex.decode(ids, [int(row.argmax()) for row in logits])
                steps.append(logits)
            results.append(np.stack(steps))
            for s in ids:
                ex.remove_sequence(s)
            assert ex._kv.free_pages() == pages
        plain, padded, past_buckets = results
        np.testing.assert_allclose(padded, plain, atol=1e-5, rtol=1e-5)
        # the prefill function computes a token as the decode function does
        np.testing.assert_array_equal(past_buckets, plain)
        assert padded.shape == (3, len(prompts), ex.vocab_size)
    finally:
        ex.close()


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gpu_layout_matmul_matches_numpy_on_cpu(kind, tiny_files):
    """The CUDA model's matmul (dequantize stage + float32 reduction) over
    the GPU layout of real GGUF weights, built for llvm from the same TE,
    equals numpy on the file's dequantized values."""
    import tvm
    from tvm import te

    from lockgate.plugins.tvm.layers import _gpu_matmul
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import _linear_arrays, linear_formats

    path = tiny_files[kind]
    reader = gguf.GGUFReader(path)
    config = ModelConfig.from_gguf(reader)
    tensors = GGUFTensors(path)
    fmt = linear_formats(tensors, config)["layers.1.mlp.down_proj"]
    parts = [("blk.1.ffn_down.weight", config.hidden_size, 0)]
    arrays = _linear_arrays(tensors, config, "layers.1.mlp.down_proj", parts, fmt, gpu=True)
    keys = ["weight"] if fmt == "f16" else ["codes", "scales"] + (["mins"] if fmt == "q4_1" else [])
    stored = [arrays[f"layers.1.mlp.down_proj.{key}"] for key in keys]
    if fmt == "f16":
        assert [a.dtype for a in stored] == [np.float16]
    else:
        assert stored[0].dtype in (np.uint32, np.int32) and stored[1].dtype == np.float16
    want_w = _read(reader, "blk.1.ffn_down.weight")  # (out, in), float64
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, config.intermediate_size)).astype(np.float16)

    xt = te.placeholder(x.shape, "float16", name="x")
    wts = [te.placeholder(a.shape, str(a.dtype), name=f"w{i}") for i, a in enumerate(stored)]
    out = _gpu_matmul(fmt, "float32", xt, *wts)
    lib = tvm.compile(te.create_prim_func([xt, *wts, out]), target="llvm")
    dev = tvm.cpu()
    result = tvm.runtime.empty((1, 5, config.hidden_size), "float32", dev)
    lib(tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for a in stored], result)
    # the half-precision dequantization rounds each weight to 11 bits
    expected = x.astype(np.float64) @ want_w.astype(np.float16).astype(np.float64).T
    np.testing.assert_allclose(result.numpy(), expected, rtol=2e-3, atol=2e-3)


def test_f16_weights_are_read_without_widening(tiny_files):
    """An F16 matrix asked for as float16 is the file's own bytes (no
    float32 copy on the way: loading a 1B F16 shape peaked at 7.1 GB
    before, 3.7 GB after), and dropping the map's pages keeps it readable."""
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors

    tensors = GGUFTensors(tiny_files["F16"])
    view = tensors.matrix("blk.0.ffn_down.weight", 64, 128, np.float16)
    widened = tensors.matrix("blk.0.ffn_down.weight", 64, 128)
    assert view.dtype == np.float16 and widened.dtype == np.float32
    assert np.shares_memory(view, tensors._tensors["blk.0.ffn_down.weight"].data)
    before = view.copy()
    tensors.release_pages()
    np.testing.assert_array_equal(view, before)
    np.testing.assert_array_equal(widened, before.astype(np.float32))


@pytest.mark.parametrize("kind", ["F32", "Q4_1", "Q4_K"])
def test_what_the_executor_reserves_is_what_it_allocates(kind, tiny_files, compile_cache, tmp_path):
    """A server's memory budget counts `ExecutorOptions.reserve`'s figures,
    told before the load: the bytes of the weights as uploaded (packed parts
    included) and of the KV pools, exactly."""
    from tiny_model import KQUANT_CONFIG

    path = tiny_files.get(kind) or write_tiny_gguf(tmp_path / "k.gguf", tensor_type=kind, **KQUANT_CONFIG)
    reserved = []
    ex = make_executor(path, compile_cache, reserve=reserved.append)
    try:
        weights = sum(np.from_dlpack(param).nbytes for param in ex._params)
        kv = ex._kv._k_np.nbytes + ex._kv._v_np.nbytes
        assert reserved == [ex.memory] == [{"weights": weights, "kv_cache": kv}]
    finally:
        ex.close()
