"""The activations' side of the CPU's 8-bit matmuls (`int8_matmul`): each
row of x cut into blocks (32 inputs, or a K-quant's super-block of 256 in
AVX2 code), each block scaled by its largest magnitude into int8, rounded
to nearest, with the scale and each scale group's sum kept for the
kernels' offsets. Written directly in TIR, one vector per 32 inputs."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as T

from lockgate.plugins.tvm.tir_vectors import bcast, halves, ramp, reduce_lanes


def quantize_activations(k_extent: int, block: int = 32, group: int = 32) -> tirx.PrimFunc:
    """x (rows, k) float32 -> x8 (rows, k) int8, dx (rows, k / block) the
    blocks' scales, sums (rows, k / group) each scale group's sum of x8
    times dx (`activation_layout` gives a format's block and group). A block
    of 32 is one vector, its largest magnitude and sums folded from it in
    registers; a block of 256 eight of them."""
    rows = tirx.Var("rows", "int64")
    vectors = block // 32
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.arg("x", T.buffer((rows, k_extent), "float32"))
            x8 = T.arg("x8", T.buffer((rows, k_extent), "int8"))
            dx = T.arg("dx", T.buffer((rows, k_extent // block), "float32"))
            sums = T.arg("sums", T.buffer((rows, k_extent // group), "float32"))
            with T.sblock("root"), T.parallel(0, rows) as r:
                with T.serial(0, k_extent // block) as b:
                    # the block's largest magnitude, held once for its uses below
                    held = T.alloc_buffer((1,), "float32", scope="global")
                    magnitude = T.abs(x[r, ramp(b * block, 32)])
                    for v in range(1, vectors):
                        magnitude = T.max(magnitude, T.abs(x[r, ramp(b * block + v * 32, 32)]))
                    T.buffer_store(held, reduce_lanes(T.max, magnitude, 32), [0])
                    amax = held[0]
                    inverse = T.Select(
                        amax > tirx.const(0.0, "float32"),
                        tirx.const(127.0, "float32") / amax,
                        tirx.const(0.0, "float32"),
                    )
                    scale = amax / tirx.const(127.0, "float32")
                    T.buffer_store(dx, scale, [r, b])
                    for v in range(vectors):
                        at = b * block + v * 32
                        codes = tirx.Cast("int32x32", T.round(x[r, ramp(at, 32)] * bcast(inverse, 32)))
                        T.buffer_store(x8, tirx.Cast("int8x32", codes), [r, ramp(at, 32)])
                        parts = [codes] if group == 32 else halves(codes, 32)[:2]
                        for h, part in enumerate(parts):
                            total = reduce_lanes(lambda a, c: a + c, part, group)
                            T.buffer_store(sums, scale * total.astype("float32"), [r, at // group + h])
    return ib.get()
