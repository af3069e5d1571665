"""The layers every model family is built from, written with
`tvm.relax.frontend.nn`: linear layers in each target's weight layout and
formats, and RMS norm.

Linear weights are stored (in, out) so the output axis is contiguous in
memory. On the CPU they are further cut into panels of `panel_width(out)`
columns, stored (out / panel, in, panel): the matmul schedule in
`compile.py` walks one panel per thread step, and a contiguous panel
streams from memory and stays in cache, where the strided columns of a plain
(in, out) matrix thrash both.

On CUDA (`GPULinear`) weights are (out, in), the layout dlight's GPU rules
read along the reduction axis, in float16, and so are the activations and
the KV cache; Q4_0, Q4_1 and Q8_0 weights stay packed as in the GGUF file
(codes plus float16 scales per 32 inputs) and are dequantized inside the
matmul. float16 rather than bfloat16: TVM 0.27's tensor-core intrinsics
(`wmma_*`/`mma_*` in `tvm.s_tir.tensor_intrin.cuda`) and dlight's
`MatmulTensorization` take float16 (or int8) inputs only, and the GGUF
scales are float16 already. Matmuls, norms and the logits accumulate in
float32; the logits leave as float32.

Several rows of activations share each loaded weight vector when the matmul
computes a row tile at once. The row count is symbolic, so a tiled matmul
writes a padded (rows / tile, tile, out) result, reading the last row again
for the padding, and a separate step drops the padding: a masked last tile
would stop TVM from keeping the accumulators in registers.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

#: the activation dtype on the CPU
DTYPE = "float32"

#: the activation, weight and KV cache dtype on CUDA
GPU_DTYPE = "float16"

#: the KV cache dtype on the CPU: half the memory of float32, and the
#: attention kernels accumulate in float32 whatever they read
CPU_KV_DTYPE = "float16"

#: rows per matmul tile in prefill and in decode of more than one sequence;
#: a single sequence's decode and the prefill LM head use untiled rows
PREFILL_ROW_TILE = 6
DECODE_ROW_TILE = 4


def panel_width(out_features: int) -> int:
    """Columns per weight panel: a vector-friendly divisor of the output
    size, or the whole output when none divides it."""
    for width in (64, 32, 16, 8):
        if out_features % width == 0:
            return width
    return out_features


def _weight_value(fmt: str, ws: list[te.Tensor], p, k, j):
    """Element (k, n) of a paneled weight, n = p·width + j, as float32.

    Quantized weights are dequantized right here, so the matmul that reads
    this expression multiplies by values it never stores: a 4-bit code is
    bits 4·(k % 8) of word k // 8, scaled by its group of 32's scale (and
    offset by its minimum for Q4_1, centred on 8 for Q4_0).
    """
    if fmt in ("f32", "f16"):
        return ws[0][p, k, j].astype("float32")
    group = k // 32
    if fmt == "q8_0":
        return ws[0][p, k, j].astype("float32") * ws[1][p, group, j]
    shift = (k % 8 * 4).astype("uint32")
    code = ((ws[0][p, k // 8, j] >> shift) & tirx.const(15, "uint32")).astype("float32")
    if fmt == "q4_0":
        return (code - tirx.const(8, "float32")) * ws[1][p, group, j]
    return code * ws[1][p, group, j] + ws[2][p, group, j]


def _panel_matmul(fmt: str, x: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    *lead, k_extent = x.shape
    panels, _, width = ws[0].shape
    k = te.reduce_axis((0, k_extent), name="k")
    return te.compute(
        (*lead, panels * width),
        lambda *i: te.sum(
            x[(*i[:-1], k)] * _weight_value(fmt, ws, i[-1] // width, k, i[-1] % width), axis=k
        ),
        name="matmul",
    )


def _row_tiled_panel_matmul(fmt: str, tile: int, x: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    rows, k_extent = x.shape
    panels, _, width = ws[0].shape
    k = te.reduce_axis((0, k_extent), name="k")
    return te.compute(
        ((rows + tile - 1) // tile, tile, panels * width),
        lambda mo, mi, n: te.sum(
            x[te.min(mo * tile + mi, rows - 1), k] * _weight_value(fmt, ws, n // width, k, n % width),
            axis=k,
        ),
        name="matmul",
    )


def _drop_row_padding(padded: te.Tensor, x: te.Tensor) -> te.Tensor:
    _, tile, n_extent = padded.shape
    return te.compute(
        (x.shape[0], n_extent),
        lambda r, n: padded[r // tile, r % tile, n],
        name="unpad_rows",
    )


def _panel_columns(fmt: str, k_extent: int, ids: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    width = ws[0].shape[2]
    return te.compute(
        (ids.shape[0], k_extent),
        lambda t, k: _weight_value(fmt, ws, ids[t] // width, k, ids[t] % width),
        name="take_columns",
    )


def _gpu_weight_value(fmt: str, ws: list[te.Tensor], n, k):
    """Element (n, k) of an (out, in) GPU weight, as float16.

    The 4-bit codes are packed as on the CPU (bits 4·(k % 8) of word k // 8)
    but rows are output features, so a thread walking k reads consecutive
    words; codes of at most 15 (or ±127) times a float16 scale are exactly
    what llama.cpp's CUDA kernels compute in half precision.
    """
    if fmt == "f16":
        return ws[0][n, k]
    scale = ws[1][n, k // 32]
    if fmt == "q8_0":
        return ws[0][n, k].astype(GPU_DTYPE) * scale
    shift = (k % 8 * 4).astype("uint32")
    code = ((ws[0][n, k // 8] >> shift) & tirx.const(15, "uint32")).astype(GPU_DTYPE)
    if fmt == "q4_0":
        return (code - tirx.const(8, GPU_DTYPE)) * scale
    return code * scale + ws[2][n, k // 32]


def _gpu_matmul(fmt: str, out_dtype: str, x: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    """x (…, in) times the (out, in) weight, accumulated in float32.

    A packed weight is dequantized by its own stage, named `dequantize`:
    dlight's GEMV inlines it into the reduction, `LowBatchGEMV` computes it
    per tile by that name, and `Matmul` inlines it into the load of the
    weight tile into shared memory, so the float16 matrix is never stored.
    """
    *lead, k_extent = x.shape
    n_extent = ws[0].shape[0]
    if fmt == "f16":
        w = ws[0]
    else:
        w = te.compute(
            (n_extent, k_extent),
            lambda n, k: _gpu_weight_value(fmt, ws, n, k),
            name="dequantize",
        )
    k = te.reduce_axis((0, k_extent), name="k")
    acc = te.compute(
        (*lead, n_extent),
        lambda *i: te.sum(
            x[(*i[:-1], k)].astype("float32") * w[i[-1], k].astype("float32"), axis=k
        ),
        name="matmul",
    )
    if out_dtype == "float32":
        return acc
    return te.compute(acc.shape, lambda *i: acc[i].astype(out_dtype), name="cast")


def _gpu_rows(fmt: str, k_extent: int, ids: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    return te.compute(
        (ids.shape[0], k_extent),
        lambda t, k: _gpu_weight_value(fmt, ws, ids[t], k),
        name="take_rows",
    )


class GPULinear(nn.Module):
    """y = x @ W.T on CUDA, W stored (out, in).

    `fmt` is one of `weights.linear_formats`' formats; float32 and other
    unpacked weights are kept as float16. Packed formats keep `codes`
    ((out, in / 8) uint32 for Q4_0/Q4_1, (out, in) int8 for Q8_0) and
    float16 `scales` (out, in / 32), plus `mins` for Q4_1.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "f16") -> None:
        self.fmt = fmt if fmt in ("q4_0", "q4_1", "q8_0") else "f16"
        self.in_features = in_features
        if self.fmt == "f16":
            self.weight = nn.Parameter((out_features, in_features), GPU_DTYPE)
            return
        if self.fmt == "q8_0":
            self.codes = nn.Parameter((out_features, in_features), "int8")
        else:
            self.codes = nn.Parameter((out_features, in_features // 8), "uint32")
        self.scales = nn.Parameter((out_features, in_features // 32), GPU_DTYPE)
        if self.fmt == "q4_1":
            self.mins = nn.Parameter((out_features, in_features // 32), GPU_DTYPE)

    def _stored(self) -> list:
        if self.fmt == "f16":
            return [self.weight]
        return [self.codes, self.scales] + ([self.mins] if self.fmt == "q4_1" else [])

    def forward(self, x: Tensor, row_tile: int = 1, out_dtype: str = GPU_DTYPE) -> Tensor:
        fmt = self.fmt
        return op.tensor_expr_op(
            lambda xt, *ws: _gpu_matmul(fmt, out_dtype, xt, *ws), "matmul", [x, *self._stored()]
        )

    def columns(self, ids: Tensor) -> Tensor:
        """W.T[:, ids] as (len(ids), in): rows of the stored weight."""
        if self.fmt == "f16":
            return op.take(self.weight, ids, axis=0)
        fmt, k_extent = self.fmt, self.in_features
        return op.tensor_expr_op(
            lambda it, *ws: _gpu_rows(fmt, k_extent, it, *ws), "take_rows", [ids, *self._stored()]
        )


class Linear(nn.Module):
    """y = x @ W on the CPU, W stored as column panels (out / panel, in, panel).

    Weights come in the formats of `weights.linear_formats`: a
    float32 or float16 `weight`, or quantized `codes` with per-32 `scales`
    (and `mins` for Q4_1), whose rows are the input features in groups of 8
    (4-bit codes packed in a uint32), 1 (Q8_0's int8) or 32 (scales).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "f32") -> None:
        self.fmt = fmt
        self.in_features = in_features
        width = panel_width(out_features)
        panels = out_features // width
        if self.fmt in ("f32", "f16"):
            dtype = "float16" if self.fmt == "f16" else "float32"
            self.weight = nn.Parameter((panels, in_features, width), dtype)
        elif self.fmt == "q8_0":
            self.codes = nn.Parameter((panels, in_features, width), "int8")
            self.scales = nn.Parameter((panels, in_features // 32, width), "float32")
        elif self.fmt in ("q4_0", "q4_1"):
            self.codes = nn.Parameter((panels, in_features // 8, width), "uint32")
            self.scales = nn.Parameter((panels, in_features // 32, width), "float32")
            if self.fmt == "q4_1":
                self.mins = nn.Parameter((panels, in_features // 32, width), "float32")
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def _stored(self) -> list:
        if self.fmt in ("f32", "f16"):
            return [self.weight]
        return [self.codes, self.scales] + ([self.mins] if self.fmt == "q4_1" else [])

    def forward(self, x: Tensor, row_tile: int = 1, out_dtype: str = DTYPE) -> Tensor:
        fmt, stored = self.fmt, self._stored()
        if row_tile == 1:
            return op.tensor_expr_op(
                lambda xt, *ws: _panel_matmul(fmt, xt, *ws), "matmul", [x, *stored]
            )
        b, s, k = x.shape
        rows = op.reshape(x, (b * s, k))
        padded = op.tensor_expr_op(
            lambda xt, *ws: _row_tiled_panel_matmul(fmt, row_tile, xt, *ws),
            "matmul",
            [rows, *stored],
        )
        out = op.tensor_expr_op(_drop_row_padding, "unpad_rows", [padded, rows])
        return op.reshape(out, (b, s, out.shape[-1]))

    def columns(self, ids: Tensor) -> Tensor:
        """W[:, ids] as (len(ids), in): the rows of the transposed weight."""
        fmt, k_extent = self.fmt, self.in_features
        return op.tensor_expr_op(
            lambda it, *ws: _panel_columns(fmt, k_extent, it, *ws),
            "take_columns",
            [ids, *self._stored()],
        )


def linear(in_features: int, out_features: int, cpu: bool, fmt: str):
    """The CPU's paneled `Linear` or CUDA's `GPULinear`."""
    if cpu:
        return Linear(in_features, out_features, fmt)
    return GPULinear(in_features, out_features, fmt)


class RMSNorm(nn.Module):
    """RMS norm with a float32 weight, computed in float32 whatever the
    activations' dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        self.weight = nn.Parameter((hidden_size,), "float32")
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == "float32":
            return op.rms_norm(x, self.weight, axes=[-1], epsilon=self.eps)
        y = op.rms_norm(x.astype("float32"), self.weight, axes=[-1], epsilon=self.eps)
        return y.astype(x.dtype)
