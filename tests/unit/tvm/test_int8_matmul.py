"""The CPU's 8-bit-activation matmuls (`plugins/tvm/int8_matmul.py`), kernel
by kernel: the activations' rounding, and every packed format's product on
both instruction sets against numpy given the same rounded activations.

AVX2 code runs on any x86 host with AVX2 (it is compiled for Haswell); the
VNNI kernels run where the host has AVX-512 VNNI and are compiled, and
their instructions checked, everywhere.
"""

from __future__ import annotations


import numpy as np
import pytest

from kquants import random_blocks  # noqa: E402

import tvm  # noqa: E402
from tvm.target import Target  # noqa: E402

from lockgate.plugins.tvm import int8_activations, int8_matmul  # noqa: E402
from lockgate.plugins.tvm.formats import FORMATS, pack_blocks, unpack_values  # noqa: E402
from lockgate.plugins.tvm.weights import to_panels  # noqa: E402

HASWELL = Target({"kind": "llvm", "mcpu": "haswell"})
ZNVER4 = Target({"kind": "llvm", "mcpu": "znver4"})


def _host_runs(isa: str) -> bool:
    host = Target.from_device(tvm.cpu())
    return int8_matmul.int8_isa(host) == isa or (isa == "avx2" and int8_matmul.int8_isa(host) is not None)


def _build(func, target):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)


def _quantized(x: np.ndarray, target, block: int = 32, group: int = 32) -> list:
    rows, k = x.shape
    lib = _build(int8_activations.quantize_activations(k, block, group), target)
    dev = tvm.cpu()
    out = [
        tvm.runtime.tensor(x, dev),
        tvm.runtime.empty((rows, k), "int8", dev),
        tvm.runtime.empty((rows, k // block), "float32", dev),
        tvm.runtime.empty((rows, k // group), "float32", dev),
    ]
    lib["main"](*out)
    return out[1:]


def test_instruction_sets_by_target():
    assert int8_matmul.int8_isa(HASWELL) == "avx2"
    assert int8_matmul.int8_isa(ZNVER4) == "avx512vnni"
    assert int8_matmul.int8_isa(Target({"kind": "llvm", "mcpu": "x86-64"})) is None
    assert int8_matmul.int8_isa(Target({"kind": "cuda", "arch": "sm_90"})) is None


@pytest.mark.skipif(not _host_runs("avx2"), reason="the host lacks AVX2")
@pytest.mark.parametrize("block, group", [(32, 32), (32, 16), (256, 32), (256, 16)])
def test_activations_round_per_block(block, group):
    """x8 = round(x · 127 / max|block|), dx = max|block| / 127, and sums the
    sums of each group's x8 times dx; a block of zeros stays zeros."""
    rng = np.random.default_rng(0)
    k = 4 * block
    x = rng.standard_normal((5, k)).astype(np.float32) * np.float32(3)
    x[2, block:2 * block] = 0
    x[3, 5] = 40.0  # one large input sets its whole block's scale
    x8, dx, sums = (a.numpy() for a in _quantized(x, HASWELL, block, group))
    blocks = x.reshape(5, 4, block)
    amax = np.abs(blocks).max(-1)
    np.testing.assert_allclose(dx, amax / 127, rtol=1e-6)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    want = np.round(blocks * inverse[..., None]).reshape(5, k)
    assert np.abs(x8 - want).max() <= 1 and (x8 == want).mean() > 0.999
    assert np.abs(x8).max() == 127
    assert (x8[2, block:2 * block] == 0).all() and dx[2, 1] == 0
    want_sums = x8.astype(np.float32).reshape(5, k // group, group).sum(-1) * np.repeat(dx, block // group, axis=1)
    np.testing.assert_allclose(sums, want_sums, rtol=1e-6)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows, tile", [(1, 1), (11, 4), (11, 8)])
def test_every_format_multiplies_the_rounded_activations(fmt, isa, rows, tile):
    """y = (x8 · dx) @ W for GGML's values of W, to float32 rounding, at one
    row and at a tile of rows with a ragged last tile."""
    target = HASWELL if isa == "avx2" else ZNVER4
    if not _host_runs(isa):
        pytest.skip(f"the host cannot run {isa}")
    k, n = 512, 48
    parts = pack_blocks(random_blocks(fmt, n, k, seed=3), n, k, fmt)
    w = unpack_values(parts, fmt)  # (out, in), GGML's values
    paneled = [np.ascontiguousarray(to_panels(parts[p.name].T, int8_matmul.LANES)) for p in FORMATS[fmt].parts]
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    block, group = int8_matmul.activation_layout(fmt, isa)
    x8, dx, sums = _quantized(x, target, block, group)
    lib = _build(int8_matmul.packed_matmul(fmt, k, n, tile, isa), target)
    dev = tvm.cpu()
    y = tvm.runtime.empty((rows, n), "float32", dev)
    lib["main"](x8, dx, sums, *[tvm.runtime.tensor(a, dev) for a in paneled], y)
    rounded = (x8.numpy().reshape(rows, -1, block) * dx.numpy()[..., None]).reshape(rows, k)
    want = rounded.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(y.numpy(), want, atol=2e-6 * scale)
    # and the rounding is what it is: within 2 % of the exact product
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert 0 < np.abs(y.numpy() - exact).max() < 0.02 * scale


@pytest.mark.parametrize("isa, instruction", [("avx512vnni", "vpdpbusd"), ("avx2", "vpmaddubsw")])
def test_kernels_use_the_integer_dot_products(isa, instruction):
    """The compiled kernel's inner loop is the integer dot product, not a
    widening to float: checked in the assembly, whatever the host."""
    target = HASWELL if isa == "avx2" else ZNVER4
    lib = _build(int8_matmul.packed_matmul("q4_k", 256, 32, int8_matmul.ROW_TILE[isa], isa), target)
    asm = lib.mod.inspect_source("s")
    assert instruction in asm
    assert "vcvtdq2ps" in asm  # the integer sums turn into float once per group


def test_the_llvm_cpu_variable_compiles_for_another_instruction_set(monkeypatch):
    """`$LOCKGATE_LLVM_CPU` names the CPU the llvm target is compiled for
    (Haswell: the AVX2 kernels, whatever the host), and the compile cache
    keeps its libraries apart from the host's."""
    from lockgate.plugins.tvm.compile import resolve_target
    from lockgate.plugins.tvm.compile_cache import LLVM_CPU_VARIABLE, _target_description

    monkeypatch.delenv(LLVM_CPU_VARIABLE, raising=False)
    host = _target_description("llvm")
    monkeypatch.setenv(LLVM_CPU_VARIABLE, "haswell")
    target = resolve_target("llvm")
    assert str(target.attrs["mcpu"]) == "haswell"
    assert int8_matmul.int8_isa(target) == "avx2"
    assert _target_description("llvm") == {**host, "llvm_cpu": "haswell"}


def test_k_quants_on_avx2_scale_activations_per_super_block():
    """AVX2 folds a K-quant's integer sub-scales into its widening, which
    needs one activation scale per super-block; VNNI and the other
    formats keep one per 32 inputs."""
    for fmt in ("q4_k", "q5_k", "q6_k"):
        assert int8_matmul.activation_block(fmt, "avx2") == int8_matmul.SUPER_BLOCK
        assert int8_matmul.activation_block(fmt, "avx512vnni") == 32
    for fmt in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        assert int8_matmul.activation_block(fmt, "avx2") == 32
