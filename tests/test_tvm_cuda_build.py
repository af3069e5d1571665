"""Cross-compile the tiny model for CUDA (sm_90) on a machine without a GPU.

The library keeps CUDA C source for every kernel, compiled at load time on a
GPU host, so this checks the whole CUDA pipeline (dlight GPU schedules, the
KV cache's GPU kernels, host code) short of running it. It needs no CUDA
toolkit: nvcc is never run here, so the test does not skip without one.
"""

from __future__ import annotations

import pathlib
import re
import sys

import gguf

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from tiny_model import write_tiny_gguf  # noqa: E402

from lockgate.models.config import LlamaConfig  # noqa: E402


def test_cross_compile_for_sm90(tmp_path):
    from lockgate.plugins.tvm.compile import as_target, compile_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = LlamaConfig.from_gguf(gguf.GGUFReader(path))
    target = as_target({"kind": "cuda", "arch": "sm_90"})
    assert target.kind.name == "cuda"
    assert target.host.kind.name == "llvm"

    messages: list[str] = []
    compiled = compile_model(config, target, tmp_path / "cache", messages.append)
    assert not compiled.cached
    assert any("compiling for cuda" in m for m in messages)

    blob = compiled.library.read_bytes()
    kernels = set(re.findall(rb'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)', blob))
    assert len(kernels) >= 20, kernels
    assert any(b"attention" in k or b"attn" in k for k in kernels), kernels
    assert any(b"matmul" in k for k in kernels), kernels

    # The GPU keeps plain (in, out) weights: every linear weight is 2-D.
    shapes = dict(compiled.params)
    assert shapes["layers.0.self_attn.qkv_proj.weight"] == (64, (4 + 2 * 2) * 16)
    assert shapes["lm_head.weight"] == (64, 299)

    again = compile_model(config, target, tmp_path / "cache")
    assert again.cached and again.library == compiled.library
