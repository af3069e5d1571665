"""The packed weight formats (`lockgate.plugins.tvm.formats`): GGML blocks
repacked bit-exactly, the kernels' dequantization equal to GGML's, and a
K-quant model that runs packed end to end.

The first tests need no compiled model: they check the repacking of every
format against gguf-py's own dequantization (an implementation independent
of lockgate's) on random blocks, which exercise every code and bit pattern.
"""

from __future__ import annotations

import pathlib
import re

import gguf
import numpy as np
import pytest


import kquants  # noqa: E402
from kquants import random_blocks  # noqa: E402
from reference_model import reference_logits  # noqa: E402
from tiny_model import KQUANT_CONFIG, Q4_K_M, write_tiny_gguf  # noqa: E402

from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.model_file import ModelFile  # noqa: E402
from lockgate.plugins.tvm.formats import FORMATS, pack_blocks, unpack_values  # noqa: E402

def test_every_packed_ggml_type_has_a_format():
    assert sorted(FORMATS) == ["q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_repacking_is_bit_exact(fmt):
    """Parts repacked from random blocks stand for exactly the float32
    values gguf-py's dequantization gives."""
    rows, cols = 6, 512
    raw = random_blocks(fmt, rows, cols)
    want = gguf.quants.dequantize(raw, FORMATS[fmt].ggml_type).reshape(rows, cols)
    parts = pack_blocks(raw, rows, cols, fmt)
    for part in FORMATS[fmt].parts:
        assert parts[part.name].shape == (rows, cols // part.per), part
        assert parts[part.name].dtype == np.dtype(part.dtype), part
    np.testing.assert_array_equal(unpack_values(parts, fmt), want.astype(np.float32))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stored_size_is_the_files(fmt):
    """A packed weight keeps about the file's bytes: the same bits a weight,
    or an eighth more for Q4_K/Q5_K's unpacked 6-bit sub-scales."""
    spec = FORMATS[fmt]
    block, block_bytes = gguf.GGML_QUANT_SIZES[spec.ggml_type]
    file_bits = block_bytes * 8 / block
    assert file_bits <= spec.bits_per_weight <= file_bits * 1.03, (spec.bits_per_weight, file_bits)


@pytest.mark.parametrize("qtype", kquants.K_TYPES, ids=lambda q: q.name)
def test_test_quantizer_round_trips(qtype):
    """The tests' own K-quant writer lays blocks out as GGML reads them:
    gguf-py's dequantization gives back the weights within a step."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 512)) * 0.1).astype(np.float32)
    back = gguf.quants.dequantize(kquants.quantize(w, qtype), qtype).reshape(w.shape)
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[qtype.name]
    step = (w.max() - w.min()) / levels
    assert np.abs(back - w).max() <= step
    assert np.abs(back - w).max() > 0  # it did quantize


def _run_te(build, inputs: list[np.ndarray], out_shape, out_dtype="float32") -> np.ndarray:
    import tvm
    from tvm import te

    holders = [te.placeholder(a.shape, str(a.dtype), name=f"in{i}") for i, a in enumerate(inputs)]
    out = build(*holders)
    lib = tvm.compile(te.create_prim_func([*holders, out]), target="llvm")
    dev = tvm.cpu()
    result = tvm.runtime.empty(out_shape, out_dtype, dev)
    lib(*[tvm.runtime.tensor(a, dev) for a in inputs], result)
    return result.numpy()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_cpu_and_gpu_kernels_dequantize_as_ggml(fmt):
    """The CPU matmul over column panels multiplies by exactly GGML's
    values (one-hot rows give back the weights bit for bit, random rows
    equal numpy's product); the CUDA layout's matmul, built for llvm, gives
    them rounded once to float16."""
    from lockgate.plugins.tvm.layers import _gpu_matmul, _panel_matmul, panel_width
    from lockgate.plugins.tvm.weights import to_panels

    rows, cols = 64, 512  # (out, in)
    parts = pack_blocks(random_blocks(fmt, rows, cols, seed=5), rows, cols, fmt)
    values = unpack_values(parts, fmt)  # (out, in), bit-exact (test above)
    width = panel_width(rows)
    paneled = [np.ascontiguousarray(to_panels(parts[p.name].T, width)) for p in FORMATS[fmt].parts]
    x = np.zeros((1, 3, cols), dtype=np.float32)
    x[0, 0, 7] = x[0, 1, 300] = 1.0
    x[0, 2] = np.random.default_rng(1).standard_normal(cols)
    got = _run_te(lambda xt, *ws: _panel_matmul(fmt, xt, *ws), [x, *paneled], (1, 3, rows))
    np.testing.assert_array_equal(got[0, 0], values[:, 7])
    np.testing.assert_array_equal(got[0, 1], values[:, 300])
    np.testing.assert_allclose(got[0, 2], values @ x[0, 2], rtol=1e-4, atol=1e-3)

    stored = [parts[p.name] for p in FORMATS[fmt].parts]
    got = _run_te(lambda xt, *ws: _gpu_matmul(fmt, "float32", xt, *ws), [x.astype(np.float16), *stored], (1, 3, rows))
    np.testing.assert_array_equal(got[0, 0], values[:, 7].astype(np.float16).astype(np.float32))


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> pathlib.Path:
    """A tiny llama in llama.cpp's Q4_K_M mix, with its own embedding table
    and head: Q4_K, Q6_K V/down projections and head."""
    return write_tiny_gguf(
        tmp_path_factory.mktemp("q4km") / "q4_k_m.gguf",
        tensor_type="Q4_K",
        tensor_types=Q4_K_M,
        seed=4,
        tie_word_embeddings=False,
        **KQUANT_CONFIG,
    )


def test_q4_k_m_runs_packed_and_exact(q4_k_m_file, tmp_path):
    """No linear of a Q4_K_M model is widened: the fused Q/K/V splits into
    its Q4_K and Q6_K parts, the head stays Q6_K and the embedding table
    Q4_K; the loaded weights are within 5 % of the file's tensor bytes; and
    the logits equal a float64 evaluation of GGML's dequantized weights
    within the float16 KV cache's rounding."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.plugins.tvm.executor import create_executor

    path = q4_k_m_file
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    options = ExecutorOptions.of(
        max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=tmp_path / "cache",
        exact_matmul=True,
    )
    ex = create_executor(ModelFile(path, config), options)
    try:
        formats = ex.compiled.formats
        assert formats["layers.0.self_attn.qkv_proj"] == "q4_k,q4_k,q6_k"
        assert formats["layers.1.mlp.down_proj"] == "q6_k"
        assert formats["lm_head"] == "q6_k" and formats["embed_tokens"] == "q4_k"
        assert not any(
            part in ("f16", "f32") for module, fmt in formats.items() if module != "cpu_activations"
            for part in fmt.split(",")
        )

        report = ex.load_report
        file_bytes = sum(row["file_bytes"] for row in report["formats"])
        loaded = sum(row["bytes"] for row in report["formats"])
        assert file_bytes <= loaded <= 1.05 * file_bytes, report
        assert not report["widened"]

        prompt, steps = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198, 45], [265, 3, 100]
        want = reference_logits(path, prompt + steps)[len(prompt) - 1 : -1]
        ex.add_sequence(0)
        got = [ex.prefill([0], [prompt])[0]]
        for token in steps[:-1]:
            got.append(ex.decode([0], [token])[0])
        np.testing.assert_allclose(np.stack(got), want, atol=2.5e-3, rtol=1e-3)
        assert np.std(want) > 0.5
    finally:
        ex.close()



@pytest.fixture(scope="module")
def q4_k_m_cache(tmp_path_factory) -> pathlib.Path:
    """One compile cache for the tests that load the Q4_K_M file as served."""
    return tmp_path_factory.mktemp("q4km-cache")


def test_q4_k_m_runs_on_8_bit_activations(q4_k_m_file, q4_k_m_cache):
    """By default the same model multiplies its packed weights by 8-bit
    activations: its logits follow a reference that rounds them alike, more
    closely than they follow the exact ones."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.plugins.tvm.executor import create_executor

    path = q4_k_m_file
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    options = ExecutorOptions.of(
        max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=q4_k_m_cache
    )
    ex = create_executor(ModelFile(path, config), options)
    try:
        prompt, steps = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198, 45], [265, 3, 100]
        rows = slice(len(prompt) - 1, -1)
        rounded = reference_logits(path, prompt + steps, int8=True)[rows]
        exact = reference_logits(path, prompt + steps)[rows]
        ex.add_sequence(0)
        got = [ex.prefill([0], [prompt])[0]]
        for token in steps[:-1]:
            got.append(ex.decode([0], [token])[0])
        got = np.stack(got)
        np.testing.assert_allclose(got, rounded, atol=0.1)
        assert (got.argmax(-1) == exact.argmax(-1)).all()
        assert np.abs(got - rounded).mean() < np.abs(got - exact).mean()
    finally:
        ex.close()


def test_packed_weights_stream_into_their_tensors_as_read_whole(q4_k_m_file, q4_k_m_cache, monkeypatch):
    """Loading writes each packed module chunk by chunk into its final
    layout (`weight_streaming`): with chunks of 64 rows (a head), so that every
    tensor takes several and the un-permuted Q/K rows, the split Q/K/V, the
    panels and the embedding table's rows all cross chunk bounds, the
    parameters are bit for bit those of repacking each tensor whole (the
    head, of 299 rows in one panel of 299, is read whole)."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.plugins.tvm import weight_streaming
    from lockgate.plugins.tvm.executor import create_executor
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import iter_gguf_weights

    path = q4_k_m_file
    metadata = GGUFMetadata(path)
    config = ModelConfig.from_gguf(metadata)
    options = ExecutorOptions.of(max_num_seqs=2, max_total_tokens=256, prefill_chunk_size=64, cache_dir=q4_k_m_cache)
    ex = create_executor(ModelFile(path, config), options)
    params, formats = ex.compiled.params, ex.compiled.formats
    ex.close()
    whole = list(iter_gguf_weights(GGUFTensors(metadata), config, params, formats=formats))
    monkeypatch.setattr(weight_streaming, "CHUNK_ROWS", 64)
    tensors = GGUFTensors(metadata)
    chunks = []
    read_rows = tensors.quantized_rows
    monkeypatch.setattr(tensors, "quantized_rows", lambda *a: chunks.append(a) or read_rows(*a), raising=False)
    streamed = list(iter_gguf_weights(tensors, config, params, formats=formats,
                                      allocate=lambda shape, dtype: np.full(shape, 7, dtype=dtype)))
    streamed_tensors = {re.sub(r"^blk\.\d+\.", "", chunk[0]) for chunk in chunks}
    assert {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
            "ffn_up.weight", "ffn_down.weight", "token_embd.weight"} <= streamed_tensors, streamed_tensors
    assert len(chunks) >= 2 * 7 * config.num_layers  # each of a layer's 7 tensors in two chunks or more
    assert [a.shape for a in streamed] == [a.shape for a in whole]
    for (name, _), got, want in zip(params, streamed, whole):
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


async def test_health_reports_the_weight_formats(tiny_model, make_client):
    """`/health` says, per model, what its weight matrices run as: the
    tiny model's float32 matrices, tensor by tensor (q, k, v, o, gate, up,
    down in each of 2 layers, and the tied head), at their file size."""
    client = await make_client(tiny_model)
    health = await client.get("/health")
    assert health.status == 200
    weights = (await health.json())["models"]["tiny"]["weights"]
    assert weights["widened"] == []
    [row] = weights["formats"]
    assert row["format"] == "f32" and row["tensors"] == 2 * 7 + 1
    assert row["bytes"] == row["file_bytes"] > 0


def test_widened_types_are_reported(tmp_path):
    """A type no kernel reads (BF16) is named in the report's "widened",
    with what it costs."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.plugins.tvm.gguf_tensors import GGUFTensors
    from lockgate.plugins.tvm.weights import describe_load_report, linear_formats, load_report

    path = write_tiny_gguf(tmp_path / "bf16.gguf", tensor_type="BF16")
    tensors = GGUFTensors(path)
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    report = load_report(tensors, config, linear_formats(tensors, config))
    assert [row["format"] for row in report["formats"]] == ["f16"]
    assert {row["type"] for row in report["widened"]} == {"BF16"}
    assert "blk.0.attn_q.weight" in {row["tensor"] for row in report["widened"]}
    assert "f16 15 tensors" in describe_load_report(report)


@pytest.mark.parametrize("fmt", ["q4_0", "q6_k"])
def test_large_matrices_repack_in_chunks_alike(fmt):
    """A matrix of more rows than one repacking chunk (a vocabulary-sized
    head) comes out as if repacked whole."""
    from lockgate.plugins.tvm import formats

    rows = formats._PACK_ROWS + 5
    raw = random_blocks(fmt, rows, 256, seed=9)
    want = gguf.quants.dequantize(raw, FORMATS[fmt].ggml_type).reshape(rows, 256)
    np.testing.assert_array_equal(unpack_values(pack_blocks(raw, rows, 256, fmt), fmt), want.astype(np.float32))
