"""HF transformers eager on random weights of a real shape: the baseline
benchmarks/gpu_check.sh sets lockgate's GPU figures against.

The model is built from its config (`LlamaForCausalLM(LlamaConfig(...))`,
the shapes of benchmarks/random_gguf.py, eager attention, random weights: no
hub download), on the GPU in bfloat16 by default. Prints, each as it is
measured: prefill tok/s of one `--prefill`-token prompt (median after a
warm-up) and decode tok/s at each of `--batches` (prompts of 16 tokens, the
cache in transformers' default DynamicCache, greedy tokens, two warm-up steps,
then up to `--decode-steps` timed steps or `--figure-seconds`).

    python benchmarks/hf_baseline.py llama-3.2-1b smollm2-135m [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from random_gguf import SHAPES, Shape  # noqa: E402

PROMPT = 16


class OutOfTime(Exception):
    pass


def build(shape: Shape, device: str, dtype: str):
    """A random-weight LlamaForCausalLM of `shape`, eager attention, on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = shape.config
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["context_length"],
        rope_theta=c["rope_theta"],
        rms_norm_eps=c["rms_norm_eps"],
        tie_word_embeddings=c["tie_word_embeddings"],
        attn_implementation="eager",
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        # built where it runs, in its dtype: initializing 1B parameters on the CPU takes long
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def measure(shape: Shape, args, deadline: float) -> None:
    import torch

    label = f"HF transformers {shape.name}"
    started = time.perf_counter()
    model = build(shape, args.device, args.dtype)
    attention = getattr(model.config, "_attn_implementation", "?")
    print(f"{label}: built in {time.perf_counter() - started:.1f} s ({args.dtype}, {attention} attention, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, on {args.device})", flush=True)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def tokens(*size: int):
        return torch.randint(3, shape.vocab_size, size, generator=generator).to(args.device)

    def out_of_time() -> bool:
        return time.monotonic() >= deadline

    def prefill() -> str:
        times = []
        for i in range(1 + args.repeats):
            if i > 1 and (out_of_time() or sum(times) > args.figure_seconds):
                break
            if i == 1 and out_of_time():
                raise OutOfTime
            ids = tokens(1, args.prefill)
            sync()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=True)
            sync()
            if i:
                times.append(time.perf_counter() - t)
        median = statistics.median(times)
        return f"{args.prefill / median:.1f} tok/s ({1000 * median:.1f} ms per prompt, median of {len(times)})"

    # transformers 5.2x calls the cache argument `cache`; earlier ones `past_key_values`
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step(ids, cache):
        out = model(input_ids=ids, use_cache=True, **({} if cache is None else {cache_arg: cache}))
        cache = out.cache if cache_arg == "cache" else out.past_key_values
        return cache, out.logits[:, -1:].argmax(-1)

    def decode(batch: int) -> str:
        cache, token = step(tokens(batch, PROMPT), None)
        for _ in range(2):
            cache, token = step(token, cache)
        if out_of_time():
            raise OutOfTime
        sync()
        steps = 0
        t = time.perf_counter()
        while steps < args.decode_steps:
            cache, token = step(token, cache)
            steps += 1
            if steps >= 2:
                sync()
                if time.perf_counter() - t > args.figure_seconds or out_of_time():
                    break
        sync()
        elapsed = time.perf_counter() - t
        return f"{batch * steps / elapsed:.1f} tok/s total ({1000 * elapsed / steps:.2f} ms/step, {steps} steps)"

    figures = [(f"prefill {args.prefill} tokens", prefill)]
    figures += [(f"decode batch {b}", lambda b=b: decode(b)) for b in args.batch_sizes]
    with torch.inference_mode():
        for name, measure_one in figures:
            if out_of_time():
                print(f"{label}: {name}: skipped, the time cap was reached", flush=True)
                continue
            try:
                print(f"{label}: {name}: {measure_one()}", flush=True)
            except OutOfTime:
                print(f"{label}: {name}: skipped, the time cap was reached while setting it up", flush=True)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype of the weights (default bfloat16)")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    parser.add_argument("--prefill", type=int, default=512, help="prefill prompt length (default 512)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills after the warm-up (default 3)")
    parser.add_argument("--figure-seconds", type=float, default=5.0,
                        help="timed seconds one figure may take at most (default 5)")
    parser.add_argument("--deadline-seconds", type=float, default=None,
                        help="figures not started by then are skipped (default: no limit)")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(f"HF transformers baseline: skipped, {exc}", flush=True)
        return 0
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"HF transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    deadline = time.monotonic() + args.deadline_seconds if args.deadline_seconds else float("inf")
    for name in args.shapes:
        if time.monotonic() >= deadline:
            print(f"HF transformers {name}: skipped, the time cap was reached", flush=True)
            continue
        measure(SHAPES[name], args, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
