"""One CPU matmul per packed format: the float32 dequantizing kernel
(`--exact-matmul`) against the 8-bit-activation kernel (`int8_matmul.py`),
side by side in one process, on random GGML blocks.

    python benchmarks/int8_kernels.py [--k 1536] [--n 576] [--rows 1,24]
        [--formats q4_k,q6_k] [--isa host|avx2|avx512vnni] [--threads 1]

Prints microseconds per call and the ratio. `--isa avx2` compiles for
Haswell (runs on any AVX2 host), `avx512vnni` for Zen 4 (needs the host to
have it); `host` takes what this CPU has.

    python benchmarks/int8_kernels.py --stream [--k 2048 --n 16384] [--threads 2]

`--stream` measures batch-1 decode as a large model meets it: each call
reads its weights from memory, not from a cache (copies of them, 512 MB in
all, are taken in turn), and the 8-bit kernel's weight bandwidth in GB/s is
printed without software prefetch and with it (`int8_matmul.PREFETCH_LINES`),
in alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1536, help="inputs (a multiple of 256 for K-quants)")
    parser.add_argument("--n", type=int, default=576, help="outputs (a multiple of 16)")
    parser.add_argument("--rows", default="1,24", help="activation rows, comma-separated")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1,q5_0,q4_k,q5_k,q6_k")
    parser.add_argument("--isa", default="host", choices=("host", "avx2", "avx512vnni"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="batch 1 from memory: GB/s with and without prefetch")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import tvm
    from kquants import random_blocks
    from tvm import te
    from tvm.s_tir import dlight as dl
    from tvm.target import Target

    from lockgate.plugins.tvm import int8_activations, int8_matmul
    from lockgate.plugins.tvm.formats import FORMATS, pack_blocks
    from lockgate.plugins.tvm.layers import PREFILL_ROW_TILE, _panel_matmul, int8_row_tile, panel_width
    from lockgate.plugins.tvm.schedules import CPUMatmul
    from lockgate.plugins.tvm.weights import to_panels

    target = {
        "host": Target.from_device(tvm.cpu()),
        "avx2": Target({"kind": "llvm", "mcpu": "haswell"}),
        "avx512vnni": Target({"kind": "llvm", "mcpu": "znver4"}),
    }[args.isa]
    isa = int8_matmul.int8_isa(target)
    if isa is None:
        sys.exit(f"no 8-bit kernels for {target}")
    dev = tvm.cpu()
    k, n = args.k, args.n

    def timed(lib, tensors) -> float:
        return lib.mod.time_evaluator("main", dev, number=20, repeat=7)(*tensors).median * 1e6

    def build(func):
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)

    if args.stream:
        stream(args, target, isa, build)
        return
    print(f"{isa}, {k} x {n}, {args.threads} thread(s); microseconds per call")
    print("| format | rows | float32 | int8 (with rounding x) | ratio |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
        for fmt in args.formats.split(","):
            block, group = int8_matmul.activation_layout(fmt, isa)
            quantize = build(int8_activations.quantize_activations(k, block, group))
            xs = [tvm.runtime.tensor(x, dev), tvm.runtime.empty((rows, k), "int8", dev),
                  tvm.runtime.empty((rows, k // block), "float32", dev),
                  tvm.runtime.empty((rows, k // group), "float32", dev)]
            t_quantize = timed(quantize, xs)
            parts = pack_blocks(random_blocks(fmt, n, k), n, k, fmt)
            spec = FORMATS[fmt]
            # float32: the schedule and panels of `layers.Linear` without int8
            wide = [np.ascontiguousarray(to_panels(parts[p.name].T, panel_width(n))) for p in spec.parts]
            xt = te.placeholder((1, rows, k), "float32", name="x")
            ws = [te.placeholder(a.shape, str(a.dtype), name=f"w{i}") for i, a in enumerate(wide)]
            mod = tvm.IRModule({"main": te.create_prim_func([xt, *ws, _panel_matmul(fmt, xt, *ws)])})
            with target:
                mod = dl.ApplyDefaultSchedule(CPUMatmul())(mod)
            lib = tvm.compile(mod, target=target)
            t_float = timed(lib, [tvm.runtime.tensor(x[None], dev), *[tvm.runtime.tensor(a, dev) for a in wide],
                                  tvm.runtime.empty((1, rows, n), "float32", dev)])
            # int8: 16-wide panels, a tile of rows as the layer picks it
            tile = int8_row_tile(isa, 1 if rows == 1 else PREFILL_ROW_TILE, fmt)
            narrow = [np.ascontiguousarray(to_panels(parts[p.name].T, int8_matmul.LANES)) for p in spec.parts]
            lib = build(int8_matmul.packed_matmul(fmt, k, n, tile, isa))
            t_int8 = timed(lib, [*xs[1:], *[tvm.runtime.tensor(a, dev) for a in narrow],
                                 tvm.runtime.empty((rows, n), "float32", dev)])
            total = t_int8 + t_quantize
            print(f"| {fmt} | {rows} | {t_float:.1f} | {total:.1f} ({t_quantize:.1f}) | {t_float / total:.2f} |")


def stream(args, target, isa: str, build) -> None:
    """Batch-1 weight bandwidth from memory, prefetch off and on."""
    import time

    import tvm
    from kquants import random_blocks

    from lockgate.plugins.tvm import int8_activations, int8_matmul
    from lockgate.plugins.tvm.formats import FORMATS, pack_blocks
    from lockgate.plugins.tvm.weights import to_panels

    dev, k, n = tvm.cpu(), args.k, args.n
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    y = tvm.runtime.empty((1, n), "float32", dev)
    print(f"{isa}, {k} x {n}, batch 1 from memory, {args.threads} thread(s); weight GB/s, median of 8 rounds")
    print(f"| format | MB | no prefetch | prefetch {int8_matmul.PREFETCH_LINES} lines | ratio |")
    print("|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        block, group = int8_matmul.activation_layout(fmt, isa)
        xs = [tvm.runtime.tensor(x, dev), tvm.runtime.empty((1, k), "int8", dev),
              tvm.runtime.empty((1, k // block), "float32", dev), tvm.runtime.empty((1, k // group), "float32", dev)]
        build(int8_activations.quantize_activations(k, block, group))["main"](*xs)
        parts = pack_blocks(random_blocks(fmt, n, k), n, k, fmt)
        panels = [np.ascontiguousarray(to_panels(parts[p.name].T, int8_matmul.LANES)) for p in FORMATS[fmt].parts]
        nbytes = sum(a.nbytes for a in panels)
        copies = [[tvm.runtime.tensor(a, dev) for a in panels] for _ in range(max(2, int(512e6 // nbytes)))]
        kernels = [build(int8_matmul.packed_matmul(fmt, k, n, 1, isa, lines))["main"]
                   for lines in (0, int8_matmul.PREFETCH_LINES)]
        seconds: list[list[float]] = [[], []]
        for _ in range(8):
            for kernel, times in zip(kernels, seconds):
                for weights in copies:
                    kernel(*xs[1:], *weights, y)
                start = time.perf_counter()
                for weights in copies:
                    kernel(*xs[1:], *weights, y)
                times.append((time.perf_counter() - start) / len(copies))
        off, on = (nbytes / np.median(t) / 1e9 for t in seconds)
        print(f"| {fmt} | {nbytes / 1e6:.1f} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
        del copies


if __name__ == "__main__":
    main()
