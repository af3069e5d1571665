"""Where one forward step's time goes, kernel by kernel: the TVM executor's
VM calls an instrument before and after every function it runs
(`TVMExecutor.set_instrument`), and this script sums the wall time per
function over one prefill and one batched decode step.

    python benchmarks/step_profile.py [--model FILE] [--tokens 256] [--batch 16]
        [--threads 2] [--exact-matmul]

Prints each function's milliseconds, calls and share of the step, largest
first. The instrument itself costs a few microseconds a call (the step's
total is printed beside the sum of its parts). On the CPU each kernel runs to
its end before the VM goes on, so the figures are the kernels' own; on CUDA
they are launch times unless the kernels synchronize.
"""

from __future__ import annotations

import argparse
import collections
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=256, help="prefill length")
    parser.add_argument("--batch", type=int, default=16, help="decode batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exact-matmul", action="store_true", help="the float32 matmuls, not 8-bit activations")
    parser.add_argument("--top", type=int, default=20, help="functions shown per step")
    args = parser.parse_args()

    from lockgate.models.config import ModelConfig
    from lockgate.engine.executor import ExecutorOptions
    from lockgate.models.model_file import ModelFile
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.plugins.models import locate_smollm2
    from lockgate.plugins.tvm.executor import create_executor

    path = args.model or str(locate_smollm2())
    config = ModelConfig.from_gguf(GGUFMetadata(path))
    options = ExecutorOptions.of(
        max_num_seqs=max(4, args.batch), max_total_tokens=max(4096, 2 * args.tokens + 64 * args.batch),
        prefill_chunk_size=args.tokens, num_threads=args.threads, exact_matmul=args.exact_matmul,
    )
    executor = create_executor(ModelFile(path, config), options)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    started: dict[str, float] = {}

    def instrument(func, name, before, result, *rest) -> int:
        now = time.perf_counter()
        if before:
            started[name] = now
        else:
            spent[name] += now - started.pop(name, now)
            calls[name] += 1
        return 0

    prompt = [10 + i % 1000 for i in range(args.tokens)]
    batch = list(range(1, args.batch + 1))

    def prefill():
        executor.add_sequence(0)
        executor.prefill([0], [prompt])
        executor.remove_sequence(0)

    def decode():
        executor.decode(batch, [7] * len(batch))

    for seq in batch:
        executor.add_sequence(seq)
        executor.prefill([seq], [[10, 11, 12]])
    for step in (prefill, decode):  # warm: first calls allocate
        step()
    executor.set_instrument(instrument)
    for label, step in ((f"prefill of {args.tokens} tokens", prefill), (f"decode at batch {args.batch}", decode)):
        spent.clear()
        calls.clear()
        begin = time.perf_counter()
        step()
        total = time.perf_counter() - begin
        print(f"{label}: {total * 1000:.1f} ms, {sum(spent.values()) * 1000:.1f} ms in VM calls")
        print("| function | ms | calls | share |")
        print("|---|---|---|---|")
        for name, seconds in sorted(spent.items(), key=lambda item: -item[1])[: args.top]:
            print(f"| {name} | {seconds * 1000:.2f} | {calls[name]} | {seconds / total:.0%} |")
        print()
    executor.close()


if __name__ == "__main__":
    main()
