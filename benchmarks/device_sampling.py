"""Decode step time with device sampling on and off, side by side.

Two TVM executors over the same model in this process, one with
`device_sampling=True` (decode returns `DeviceLogits`; `executor.sample`
runs the sampler's kernels where the logits are) and one with it off
(logits copied to the host; numpy samples them). Both decode the same
sequences from the same tokens, step by step and alternating which goes
first, and the script checks that they generate the same tokens. Per batch
size and request kind it prints the median milliseconds of `decode`, of
`sample`, and of the two together (a step), after two warm-up steps.

    python benchmarks/device_sampling.py [--target llvm|cuda] [--batches 16,64]
        [--kinds greedy,temperature,top_k_top_p,logprobs] [--steps 12] [--model PATH]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from executor import default_model_path  # noqa: E402

from lockgate.engine.params import SamplingParams  # noqa: E402
from lockgate.engine.sampling import SamplingRow, make_generator  # noqa: E402
from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.model_file import ModelFile  # noqa: E402

KINDS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.9),
    "logprobs": dict(temperature=0.0, logprobs=5),
}
PROMPT_TOKENS = 24


def measure(executors: dict, batch: int, kind: str, steps: int, rng: np.random.Generator) -> dict:
    vocab = next(iter(executors.values())).vocab_size
    prompts = [rng.integers(100, vocab, PROMPT_TOKENS).tolist() for _ in range(batch)]
    first = rng.integers(100, vocab, batch).tolist()
    ids = list(range(1000, 1000 + batch))
    params = SamplingParams(seed=1, **KINDS[kind])
    state = {}
    for mode, ex in executors.items():
        for seq_id in ids:
            ex.add_sequence(seq_id)
        chunk = max(1, ex.prefill_chunk_size // PROMPT_TOKENS)
        for start in range(0, batch, chunk):
            ex.prefill(ids[start:start + chunk], prompts[start:start + chunk])
        rngs = [None if params.greedy else make_generator(params, i) for i in range(batch)]
        state[mode] = (list(first), [[] for _ in ids], rngs)
    times = {mode: {"decode": [], "sample": [], "step": []} for mode in executors}
    try:
        for step in range(steps + 2):
            order = list(executors) if step % 2 == 0 else list(executors)[::-1]
            for mode in order:
                ex = executors[mode]
                tokens, outputs, rngs = state[mode]
                rows = [SamplingRow(params, rngs[i], prompts[i], outputs[i]) for i in range(batch)]
                t0 = time.perf_counter()
                logits = ex.decode(ids, tokens)
                t1 = time.perf_counter()
                chosen, _ = ex.sample(logits, rows)
                t2 = time.perf_counter()
                tokens[:] = chosen.tolist()
                for out, token in zip(outputs, tokens):
                    out.append(token)
                if step >= 2:
                    times[mode]["decode"].append(t1 - t0)
                    times[mode]["sample"].append(t2 - t1)
                    times[mode]["step"].append(t2 - t0)
    finally:
        for ex in executors.values():
            for seq_id in ids:
                ex.remove_sequence(seq_id)
    outputs = [state[mode][1] for mode in executors]
    same = all(out == outputs[0] for out in outputs)
    return {
        "same": same,
        **{mode: {k: 1000 * statistics.median(v) for k, v in t.items()} for mode, t in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="llvm", choices=("llvm", "cuda"))
    parser.add_argument("--model", type=pathlib.Path, default=None)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None)
    args = parser.parse_args()

    from lockgate.plugins.tvm.executor import create_executor

    path = args.model or default_model_path()
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    batches = [int(b) for b in args.batches.split(",")]
    executors = {
        mode: create_executor(
            ModelFile(path, config),
            ExecutorOptions.of(
                max_num_seqs=max(batches),
                max_total_tokens=max(batches) * (PROMPT_TOKENS + args.steps + 8) * 2,
                target=args.target,
                num_threads=args.threads,
                cache_dir=args.cache_dir,
                device_sampling=mode == "on",
            ),
        )
        for mode in ("off", "on")
    }
    rng = np.random.default_rng(0)
    print(f"{path.name} on {args.target}, median ms of {args.steps} steps")
    print("| kind | batch | decode off / on | sample off / on | step off / on | on / off | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for batch in batches:
            r = measure(executors, batch, kind, args.steps, rng)
            off, on = r["off"], r["on"]
            print(
                f"| {kind} | {batch} | {off['decode']:.1f} / {on['decode']:.1f} | "
                f"{off['sample']:.2f} / {on['sample']:.2f} | {off['step']:.1f} / {on['step']:.1f} | "
                f"{on['step'] / off['step']:.2f} | {'yes' if r['same'] else 'NO'} |",
                flush=True,
            )
    for ex in executors.values():
        ex.close()


if __name__ == "__main__":
    main()
