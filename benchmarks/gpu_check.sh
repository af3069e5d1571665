#!/usr/bin/env bash
# GPU check of lockgate, for the offline GPU host (NVIDIA H200, no network,
# see ../shared/gpu/README.md). After its two payloads, from the project root:
#
#     source .gpu/p2/setup.sh && bash benchmarks/gpu_check.sh [WORKDIR]
#
# Installs nothing and downloads nothing: lockgate, TVM and gguf must be
# importable (setup.sh puts them in /tmp/site); torch and transformers are
# used when present. Prints one line per figure as it is measured:
#
# 1. writes random-weight GGUF files of real shapes (benchmarks/random_gguf.py;
#    torch on the GPU when present, else numpy): Llama-3.2-1B in F16 and in
#    Q4_0, SmolLM2-135M in F16;
# 2. executor figures (benchmarks/executor.py --sweep): prefill tok/s in
#    512-token chunks and decode tok/s at batch 1, 16, 64 and 256, for each
#    of the three files;
# 3. served figures (benchmarks/load.py --launch-lockgate on the 135M file):
#    output tok/s and TTFT at concurrency 1, 16, 64 and 256;
# 4. HF transformers eager, bf16, on the same shapes (benchmarks/hf_baseline.py):
#    prefill 512 and decode tok/s at batch 1, 16 and 64.
#
# Every stage has a time cap and the whole check a budget (GPU_CHECK_BUDGET,
# 450 s): a stage that overruns is stopped, a figure not reached prints as
# skipped, a stage that no longer fits prints as skipped, and the last line
# is the total elapsed time.
#
#     GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh   # anywhere, on the CPU: tiny shapes, few steps
#
# GPU_CHECK_TARGET overrides the compile target (cuda; llvm in smoke mode),
# GPU_CHECK_CAPS the six stage caps (seconds, space-separated).
# WORKDIR (default a new temporary folder) keeps the model files; files
# already there are reused.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
smoke="${GPU_CHECK_SMOKE:-0}"
budget="${GPU_CHECK_BUDGET:-450}"
work="${1:-$(mktemp -d -t lockgate-gpu-XXXXXX)}"
mkdir -p "$work"
start=$SECONDS

if [ "$smoke" = 1 ]; then
    target="${GPU_CHECK_TARGET:-llvm}"
    big=tiny small=tiny small_type=F16
    batches=1,4,16 hf_batches=1,4 decode_steps=4 figure_s=1 prefill=64
    levels=1,4 requests=4 max_tokens=8 kv_tokens=8192
    # stage caps (s): models, the three executor sweeps, served, HF
    caps=(60 60 60 60 90 60)
else
    target="${GPU_CHECK_TARGET:-cuda}"
    big=llama-3.2-1b small=smollm2-135m small_type=F16
    batches=1,16,64,256 hf_batches=1,16,64 decode_steps=32 figure_s=4 prefill=512
    levels=1,16,64,256 requests=256 max_tokens=32 kv_tokens=65536
    caps=(90 70 65 45 95 60)
fi
if [ -n "${GPU_CHECK_CAPS:-}" ]; then
    read -r -a caps <<< "$GPU_CHECK_CAPS"
fi

elapsed() { echo $((SECONDS - start)); }

# begin NAME CAP: prints the stage's header and sets $cap (its cap, cut to
# what the budget has left) and $soft (the deadline its Python gets, leaving
# time to print and close); false, with a "skipped" line, when under 15 s remain.
begin() {
    local name=$1 left=$((budget - (SECONDS - start)))
    cap=$2
    ((cap > left)) && cap=$left
    if ((cap < 15)); then
        echo "== $name: skipped, $left s of the $budget s budget left"
        return 1
    fi
    soft=$((cap - 10))
    echo "== $name (cap ${cap} s; $(elapsed) s elapsed)"
}

# capped CMD...: runs CMD under $cap; SIGINT first (load.py then stops its
# server), SIGKILL 20 s later.
capped() {
    timeout -s INT -k 20 "$cap" "$@"
    local rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "   stopped at its cap of ${cap} s"
    elif ((rc != 0)); then
        echo "   exit status $rc"
    fi
    return 0
}

echo "== lockgate GPU check$([ "$smoke" = 1 ] && echo ' (smoke: tiny shapes, few steps)'): target $target, budget $budget s, work folder $work"
if ! "$py" -c "import tvm, gguf, aiohttp, lockgate" 2>/dev/null; then
    echo "lockgate, TVM, gguf or aiohttp is not importable by $py: on the GPU host, run" >&2
    echo "'source .gpu/p2/setup.sh' (../shared/gpu/README.md) first; this script installs nothing" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$py" - "$target" <<'EOF'
import sys

import lockgate
import tvm

line = f"tvm {tvm.__version__}, lockgate from {lockgate.__path__[0]}"
device = tvm.cuda()
line += f", CUDA device: {device.compute_version}" if device.exist else ", no CUDA device"
try:
    import torch

    line += f", torch {torch.__version__} (CUDA {'yes' if torch.cuda.is_available() else 'no'})"
except ImportError:
    line += ", no torch"
print(line)
if sys.argv[1] == "cuda" and not device.exist:
    sys.exit("target cuda but TVM sees no CUDA device; GPU_CHECK_SMOKE=1 runs the check on the CPU")
EOF
[ $? = 0 ] || exit 2

f16="$work/random-$big-F16.gguf"
q4="$work/random-$big-Q4_0.gguf"
small_file="$work/random-$small-$small_type.gguf"

if begin "random-weight models" "${caps[0]}"; then
    capped "$py" benchmarks/random_gguf.py "$work" "$small:$small_type" "$big:F16" "$big:Q4_0"
fi

sweep() {  # sweep LABEL FILE CAP
    if [ ! -f "$2" ]; then
        echo "== executor $1: skipped, $2 was not written"
    elif begin "executor $1" "$3"; then
        capped "$py" benchmarks/executor.py --sweep --model "$2" --label "$1" --target "$target" \
            --batches "$batches" --prefill-chunk "$prefill" --decode-steps "$decode_steps" \
            --figure-seconds "$figure_s" --deadline-seconds "$soft"
    fi
}
sweep "$big F16" "$f16" "${caps[1]}"
sweep "$big Q4_0" "$q4" "${caps[2]}"
sweep "$small $small_type" "$small_file" "${caps[3]}"

if [ ! -f "$small_file" ]; then
    echo "== served $small: skipped, $small_file was not written"
elif begin "served $small $small_type, load.py" "${caps[4]}"; then
    # The random models' tokenizer has few merges: --prompt-tokens 36 comes
    # out at about 130 tokens (the "prompt tok" column counts them). Each level
    # starts no request after $level_s s (the rest show as skip:N).
    level_s=$(((cap - 35) / 8))
    ((level_s < 3)) && level_s=3
    capped "$py" benchmarks/load.py --launch-lockgate --lockgate-model "$small_file" \
        --lockgate-args "--target $target --max-total-tokens $kv_tokens" \
        --concurrency "$levels" --requests "$requests" --max-tokens "$max_tokens" --ignore-eos \
        --prompt-tokens 36 --warmup 2 --level-seconds "$level_s" --timeout "$cap" \
        --launch-timeout "$((cap - 20))"
fi

if begin "HF transformers eager, bf16" "${caps[5]}"; then
    shapes="$big $small"
    [ "$big" = "$small" ] && shapes=$big
    # shellcheck disable=SC2086  # two shape names
    capped "$py" benchmarks/hf_baseline.py $shapes --dtype bfloat16 --batches "$hf_batches" \
        --prefill "$prefill" --decode-steps "$decode_steps" --figure-seconds "$figure_s" --deadline-seconds "$soft"
fi

echo "== total elapsed: $(elapsed) s (budget $budget s)"
