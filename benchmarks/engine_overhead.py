"""Engine overhead: what the engine and the HTTP layer cost per step and per
streamed token, with an executor whose forward passes cost nothing.

It starts the server `lockgate serve` runs (the same app, in a subprocess
of its own) on the tests' tiny model with the `zero-cost` executor
(`tests/support/zero_cost_executor.py`: logits from a precomputed table, the next
token a fixed function of the last one), registered through
`lockgate_register_executors` by this script, never shipped. Then it streams
greedy chat completions through HTTP at each concurrency with `load.py`'s
client, which reads the SSE bytes with plain aiohttp (no openai SDK, whose
per-chunk cost would be measured instead of the server's), and prints per
level: streamed tokens per second, wall microseconds per token, and the CPU
microseconds per token the server process and this client process spent.
Every streamed answer is checked against the text the executor must
produce, so a faster server that loses or garbles tokens does not count.

    python benchmarks/engine_overhead.py                    # c = 1, 16, 64, 256
    python benchmarks/engine_overhead.py --concurrency 64 --repeat 5
    python benchmarks/engine_overhead.py --concurrency 64 --vocab 49152 --temperature 0.7

`--vocab` pads the tiny model's vocabulary (the default model's is 49,152
tokens), which is what sampling and the detokenizer's tables scale with;
`--temperature` sends it with every request, so the host sampler draws
each token (the executor's logits give every token a runner-up). A
sampled answer is not known in advance: at a temperature only its length
is checked.

The client runs on the same cores as the server: on a small machine the
tok/s are the two together; the CPU columns tell them apart.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import load  # noqa: E402  (benchmarks/load.py: the client and the launcher)

SERVED_NAME = "overhead"
#: the tiny model's context: room for a prompt and a long answer
CONTEXT_LENGTH = 2048


# ------------------------------------------------------------------ the server side


def serve(args: argparse.Namespace) -> None:
    """`--serve` mode: the app of `lockgate serve` with the zero-cost executor."""
    import faulthandler

    from aiohttp import web

    from lockgate.logging import configure_logging
    from lockgate.plugin_api.manager import get_plugin_manager
    from lockgate.server.app import create_app
    from lockgate.server.config import Settings
    from zero_cost_executor import ZeroCostExecutors

    settings = Settings.from_env(
        model=args.model_path, served_model_name=SERVED_NAME, host="127.0.0.1", port=args.port,
        executor="zero-cost", max_num_seqs=args.max_num_seqs,
        max_total_tokens=args.max_num_seqs * CONTEXT_LENGTH, max_queue=max(256, 2 * args.max_num_seqs),
    )
    configure_logging(settings.log_format, settings.log_level)
    faulthandler.enable()
    app = create_app(settings, pm=get_plugin_manager(autoload=False, plugins=[ZeroCostExecutors()]))
    loop_profile = None
    if args.profile:
        loop_profile = profile_engine_thread_and_start(pathlib.Path(args.profile))
    try:
        # as `lockgate serve` runs it (lockgate.server.cli)
        web.run_app(app, host=settings.host, port=settings.port, handler_cancellation=True, access_log=None,
                    shutdown_timeout=5, print=None)
    finally:
        if loop_profile is not None:
            loop_profile.disable()
            loop_profile.dump_stats(pathlib.Path(args.profile) / "event-loop.prof")


def profile_engine_thread_and_start(folder: pathlib.Path):
    """cProfile the engine thread (into `folder`/engine.prof when it stops)
    and return a started profile of this, the event loop's, thread."""
    import cProfile

    from lockgate.engine.loop import Engine

    run = Engine._run

    def profiled(engine) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            run(engine)
        finally:
            profile.disable()
            profile.dump_stats(folder / "engine.prof")

    Engine._run = profiled
    profile = cProfile.Profile()
    profile.enable()
    return profile


def print_profiles(folder: pathlib.Path, lines: int) -> None:
    import pstats

    for name in ("event-loop", "engine", "client"):
        path = folder / f"{name}.prof"
        if not path.exists():
            print(f"\n(no profile of the {name} thread)")
            continue
        print(f"\n--- {name} thread (cProfile, by own time; cProfile inflates small calls)")
        stats = pstats.Stats(str(path))
        stats.sort_stats("tottime").print_stats(lines)


# ------------------------------------------------------------------ the client side


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Level:
    concurrency: int
    requests: int
    tokens: int
    wall: float
    server_cpu: float
    client_cpu: float
    wrong: int
    failed: int
    ttft_p50: float | None

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    def per_token_us(self, seconds: float) -> float:
        return seconds / self.tokens * 1e6 if self.tokens else float("nan")


def expected_texts(model_path: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """What the zero-cost executor streams for each chat prompt, greedily."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.models.tokenizer import load_tokenizer
    from zero_cost_executor import ZeroCostExecutor, word_tokens

    tokenizer = load_tokenizer(GGUFMetadata(model_path))
    executor = ZeroCostExecutor(vocab_size=len(tokenizer), word_tokens=word_tokens(tokenizer))
    texts = {}
    for prompt in prompts:
        # rendered and tokenized as the server's template and tokenize plugins do
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        last = tokenizer.encode(rendered, add_special_tokens=False)[-1]
        texts[prompt] = tokenizer.decode(executor.expected_tokens(last, max_tokens))
    return texts


async def run_level(
    server: load.Server, pid: int, concurrency: int, prompts: list[str], expected: str | None, args
) -> Level:
    """One level; `expected` is every answer's text (None: check lengths only)."""
    server_cpu, client_cpu = process_cpu_seconds(pid), time.process_time()
    result = await load.run_level(server, concurrency, prompts, args)
    server_cpu, client_cpu = process_cpu_seconds(pid) - server_cpu, time.process_time() - client_cpu
    ok = [r for r in result.results if r.ok]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    return Level(
        concurrency=concurrency,
        requests=len(prompts),
        tokens=sum(r.tokens for r in ok),
        wall=result.wall,
        server_cpu=server_cpu,
        client_cpu=client_cpu,
        wrong=sum(1 for r in ok if (expected is not None and r.text != expected) or r.tokens != args.max_tokens),
        failed=len(prompts) - len(ok),
        ttft_p50=statistics.median(ttfts) if ttfts else None,
    )


def requests_at(concurrency: int, args) -> int:
    return max(args.min_requests, args.rounds * concurrency)


HEADER = (f"{'conc':>5} {'requests':>8} {'tokens':>7} {'tok/s':>8} {'wall us/tok':>11} "
          f"{'server cpu us/tok':>17} {'client cpu us/tok':>17} {'ttft p50 ms':>11} {'wrong':>5} {'failed':>6}")


def row(level: Level) -> str:
    ttft = "-" if level.ttft_p50 is None else f"{level.ttft_p50 * 1000:.1f}"
    return (f"{level.concurrency:>5} {level.requests:>8} {level.tokens:>7} {level.tps:>8.0f} "
            f"{level.per_token_us(level.wall):>11.1f} {level.per_token_us(level.server_cpu):>17.1f} "
            f"{level.per_token_us(level.client_cpu):>17.1f} {ttft:>11} {level.wrong:>5} {level.failed:>6}")


async def benchmark(args: argparse.Namespace) -> tuple[int, list[Level]]:
    from tiny_model import write_tiny_gguf

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="lockgate-overhead-"))
    model_path = str(write_tiny_gguf(workdir / "tiny.gguf", context_length=CONTEXT_LENGTH, vocab_size=args.vocab))
    port = load.free_port()
    command = [sys.executable, __file__, "--serve", "--model-path", model_path, "--port", str(port),
               "--max-num-seqs", str(max(args.levels))]
    if args.profile:
        pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
        command += ["--profile", str(args.profile)]
    launched = load.Launched("lockgate", command, port)
    levels: list[Level] = []
    try:
        await launched.wait_healthy(args.launch_timeout)
        server = load.Server(label="lockgate", base_url=launched.base_url, model=SERVED_NAME)
        prompts = load.make_prompts(max(requests_at(c, args) for c in args.levels), args.prompt_words, args.seed)
        expected = expected_texts(model_path, prompts, args.max_tokens)
        # every prompt of the run ends the same way, so every answer is the same text
        if len(set(expected.values())) != 1:
            raise SystemExit("error: the prompts' expected answers differ; the check assumes one")
        answer = next(iter(expected.values())) if not args.temperature else None
        sampling = f"temperature {args.temperature}" if args.temperature else "greedy"
        vocab = f"vocabulary padded to {args.vocab}" if args.vocab else "its own vocabulary"
        print(f"server pid {launched.process.pid} (log {launched.log.name}); client: load.py's raw aiohttp "
              f"SSE reader, no openai SDK; chat, {sampling}, ~{args.prompt_words}-word prompts, "
              f"max_tokens {args.max_tokens} (ignore_eos), zero-cost executor, tiny model, {vocab}", flush=True)
        await load.run_level(server, 1, prompts[: args.warmup], args)
        client_profile = None
        if args.profile:
            import cProfile

            client_profile = cProfile.Profile()
            client_profile.enable()
        print(HEADER, flush=True)
        for _ in range(args.repeat):
            for concurrency in args.levels:
                level = await run_level(server, launched.process.pid, concurrency,
                                        prompts[: requests_at(concurrency, args)], answer, args)
                levels.append(level)
                print(row(level), flush=True)
        if args.repeat > 1:
            print(f"\nmedians of {args.repeat} runs")
            print(HEADER)
            for concurrency in args.levels:
                runs = [lv for lv in levels if lv.concurrency == concurrency]
                median = sorted(runs, key=lambda lv: lv.tps)[len(runs) // 2]
                print(row(median))
        if client_profile is not None:
            client_profile.disable()
            client_profile.dump_stats(pathlib.Path(args.profile) / "client.prof")
    finally:
        launched.stop()
    if args.profile:
        print_profiles(pathlib.Path(args.profile), args.profile_lines)
    bad = sum(lv.wrong + lv.failed for lv in levels)
    return (1 if bad else 0), levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", action="append", default=[],
                        help="streams in flight; repeatable or a comma list (default 1,16,64,256)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default 128)")
    parser.add_argument("--prompt-words", type=int, default=16, help="about this many words a prompt (default 16)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="requests per level: this many times the concurrency ... (default 4)")
    parser.add_argument("--min-requests", type=int, default=64, help="... and at least this many (default 64)")
    parser.add_argument("--repeat", type=int, default=1, help="run the levels this many times; medians (default 1)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests first (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=None,
                        help="pad the tiny model's vocabulary to this many tokens (the default model has 49152)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default 0: greedy); above 0 only "
                             "answer lengths are checked")
    parser.add_argument("--launch-timeout", type=float, default=120.0)
    parser.add_argument("--profile", metavar="DIR",
                        help="cProfile the server's event-loop and engine threads and this client into DIR "
                             "and print where their time went (slows everything down)")
    parser.add_argument("--profile-lines", type=int, default=25, help="functions per profile printed (default 25)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.levels = load.parse_levels(args.concurrency or ["1,16,64,256"])
    # what load.run_level and load.request_body read
    args.endpoint, args.ignore_eos, args.model = "chat", True, SERVED_NAME
    args.timeout, args.level_seconds, args.api_key = 300.0, 600.0, None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    code, _ = asyncio.run(benchmark(args))
    return code


if __name__ == "__main__":
    sys.exit(main())
