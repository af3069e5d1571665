"""Vector expressions for kernels written in TIR by hand (`int8_matmul`,
`int8_activations`): ramps and broadcasts, casts to float32 vectors, a
vector's halves, and its lanes folded into one value."""

from __future__ import annotations

from tvm import tirx

#: output columns per weight panel: one 512-bit vector of int32 (or float32) sums
LANES = 16


def ramp(start, lanes: int):
    return tirx.Ramp(start, 1, lanes)


def bcast(value, lanes: int):
    return tirx.Broadcast(value, lanes)


def u8(value: int):
    return bcast(tirx.const(value, "uint8"), 64)


def f32(expr, lanes: int = LANES):
    return tirx.Cast(f"float32x{lanes}", expr)


def halves(vec, lanes: int):
    half = lanes // 2
    lo = tirx.Shuffle([vec], [tirx.const(i, "int32") for i in range(half)])
    hi = tirx.Shuffle([vec], [tirx.const(i, "int32") for i in range(half, lanes)])
    return lo, hi, half


def reduce_lanes(combine, vec, lanes: int):
    """A vector's lanes folded pairwise with `combine` into one value."""
    while lanes > 1:
        lo, hi, lanes = halves(vec, lanes)
        vec = combine(lo, hi)
    return vec
