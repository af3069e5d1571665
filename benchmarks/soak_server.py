"""The server `soak.py` starts: `lockgate serve` itself (its start-up, its
signal handling, its process settings), with the executor wrapped so that
one forward pass in `--fault-every` fails."""

from __future__ import annotations

import argparse
import time


class FaultyExecutor:
    """The real executor, failing every `every`-th forward pass (0: never),
    each failure written to `fault_log`."""

    def __init__(self, real, every: int, fault_log) -> None:
        self.real, self.every, self.calls, self.fault_log = real, every, 0, fault_log

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _maybe_fail(self, kind: str) -> None:
        self.calls += 1
        if self.every and self.calls % self.every == 0:
            self.fault_log.write(f"{time.time()} {kind}\n")
            raise RuntimeError(f"injected {kind} fault")

    def prefill(self, seq_ids, token_ids, all_positions=None):
        self._maybe_fail("prefill")
        return self.real.prefill(seq_ids, token_ids, all_positions)

    def decode(self, seq_ids, token_ids):
        self._maybe_fail("decode")
        return self.real.decode(seq_ids, token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fault-log", required=True)
    parser.add_argument("--fault-every", type=int, default=0)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-body-size", type=int, default=4 * 1024 * 1024)
    args = parser.parse_args()

    from lockgate.plugin_api.hookspecs import hookimpl
    from lockgate.plugin_api.manager import get_plugin_manager
    from lockgate.plugins.tvm import create_executor
    from lockgate.server.cli import serve
    from lockgate.server.config import Settings

    fault_log = open(args.fault_log, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)

    class FaultInjection:
        @hookimpl
        def lockgate_register_executors(self, register):
            register("faulty-tvm", lambda model_file, options: FaultyExecutor(
                create_executor(model_file, options), args.fault_every, fault_log))

    settings = Settings.from_env(
        model=args.model_path, served_model_name="soak", host="127.0.0.1", port=args.port, executor="faulty-tvm",
        max_queue=args.max_queue, max_num_seqs=args.max_num_seqs, max_body_size=args.max_body_size,
        log_format="json", log_level="warning", shutdown_grace=5,
    )
    serve(settings, pm=get_plugin_manager(plugins=[FaultInjection()]))


if __name__ == "__main__":
    main()
