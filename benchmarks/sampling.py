"""Host (numpy) sampling against the device sampler compiled for llvm.

Times `lockgate.engine.sampling.sample_batch` on numpy logits and
`lockgate.plugins.tvm.sampler.DeviceSampler.sample_batch` on the same
logits already in a TVM tensor on the CPU (where the executor's output is),
per batch size and kind of request; prints the median of `--repeats` calls
in milliseconds and checks on the way that both choose the same tokens: the
host draws in float32, the device in float64, so a row's draw may differ
where its uniform falls within float32 rounding of a boundary between two
tokens (about one sampled row in a thousand on these flat random rows);
"differ" counts them, and more than 1 % of all rows compared (and more
than one) fails the script.

    python benchmarks/sampling.py [--vocab 49152] [--batches 1,16,64] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

KINDS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8, seeded": {"temperature": 0.8},
    "top-k 40 + top-p 0.9": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "penalties + bias": {
        "temperature": 0.8,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.1,
        "logit_bias": {11: 3.0, 12: -100.0},
    },
    "logprobs 5, greedy": {"temperature": 0.0, "logprobs": 5},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    from tvm.target import Target

    from lockgate.engine.params import SamplingParams
    from lockgate.engine.sampling import SamplingRow, make_generator, sample_batch
    from lockgate.plugins.tvm.sampler import DeviceSampler

    started = time.monotonic()
    sampler = DeviceSampler(args.vocab, Target.from_device(tvm.cpu()), tvm.cpu(0))
    print(f"sampler compiled for llvm in {time.monotonic() - started:.1f} s; vocab {args.vocab}")
    rng = np.random.default_rng(0)
    history = list(rng.integers(0, args.vocab, 200))
    compared = differed = 0
    print(f"{'kind':<26}{'batch':>6}{'host ms':>10}{'device ms':>11}{'host/device':>13}{'differ':>8}")
    for kind, fields in KINDS.items():
        for batch in (int(b) for b in args.batches.split(",")):
            logits = (rng.standard_normal((batch, args.vocab)) * 3).astype(np.float32)
            on_device = tvm.runtime.tensor(logits, tvm.cpu(0))
            params = [SamplingParams(seed=i, **fields) for i in range(batch)]

            def rows():
                return [
                    SamplingRow(p, make_generator(p, 0), history[:150], history[150:]) for p in params
                ]

            host_tokens, _ = sample_batch(logits, rows())
            device_tokens, _ = sampler.sample_batch(on_device, rows())
            differ = int((host_tokens != device_tokens).sum())
            compared += batch
            differed += differ
            times = {"host": [], "device": []}
            for _ in range(args.repeats):
                for name, run, source in (
                    ("host", sample_batch, logits),
                    ("device", sampler.sample_batch, on_device),
                ):
                    r = rows()  # fresh generators, built outside the timing
                    t = time.perf_counter()
                    run(source, r)
                    times[name].append(time.perf_counter() - t)
            host = statistics.median(times["host"]) * 1e3
            device = statistics.median(times["device"]) * 1e3
            print(f"{kind:<26}{batch:>6}{host:>10.2f}{device:>11.2f}{host / device:>13.2f}{differ:>8}")

    if differed > max(1, 0.01 * compared):
        raise SystemExit(f"the samplers chose different tokens for {differed} of {compared} rows")


if __name__ == "__main__":
    main()
