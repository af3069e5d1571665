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
the KV cache. On both targets a GGUF weight of a packed type (`formats.py`:
Q4_0 to Q8_0 and the K-quants) stays packed, as codes and scales close to
the file's bytes, and is dequantized inside the matmul. float16 rather than bfloat16: TVM 0.27's tensor-core intrinsics
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

import dataclasses
import functools

from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from lockgate.plugins.tvm import int8_activations, int8_matmul
from lockgate.plugins.tvm.formats import CPU_ACTIVATIONS, FORMATS, split_groups

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


@dataclasses.dataclass(frozen=True)
class CPU:
    """What the CPU's layers are built with (layers take None on CUDA)."""

    #: instruction set of the 8-bit-activation matmuls
    #: (`int8_matmul.int8_isa`), None to dequantize packed weights to float32
    int8: str | None = None

    @classmethod
    def for_target(cls, target, formats: dict) -> "CPU | None":
        if target.kind.name != "llvm":
            return None
        wanted = formats.get(CPU_ACTIVATIONS, "int8")
        if wanted not in ("int8", "float32"):
            raise ValueError(f"{CPU_ACTIVATIONS} must be 'int8' or 'float32', not {wanted!r}")
        return cls(int8_matmul.int8_isa(target) if wanted == "int8" else None)


def panel_width(out_features: int) -> int:
    """Columns per weight panel: a vector-friendly divisor of the output
    size, or the whole output when none divides it."""
    for width in (64, 32, 16, 8):
        if out_features % width == 0:
            return width
    return out_features


def _value(fmt: str, ws: list[te.Tensor], at, k):
    """Element k (along the input) of one output feature of a stored
    weight, as float32: `at(array, per)` reads an array at `k // per` for
    that output. A packed weight is dequantized right here
    (`formats.FORMATS`), so the kernel reading this expression uses values
    it never stores."""
    if fmt in ("f32", "f16"):
        return at(ws[0], 1).astype("float32")
    arrays = {part.name: (w, part.per) for part, w in zip(FORMATS[fmt].parts, ws)}
    return FORMATS[fmt].value(lambda name: at(*arrays[name]), k)


def _weight_value(fmt: str, ws: list[te.Tensor], p, k, j):
    """Element (k, n) of a paneled weight, n = p·width + j, as float32."""
    return _value(fmt, ws, lambda w, per: w[p, k // per, j], k)


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

    The packed parts are those of the CPU (`formats.FORMATS`), rows being
    output features, so a thread walking k reads consecutive words; the
    value is computed in float32, exactly as GGML's dequantization, and
    rounded once to float16, as llama.cpp's CUDA kernels round the weights
    they hand to half-precision matmuls.
    """
    if fmt == "f16":
        return ws[0][n, k]
    return _value(fmt, ws, lambda w, per: w[n, k // per], k).astype(GPU_DTYPE)


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


def _packed_parameters(module: nn.Module, fmt: str, in_features: int, shape_of) -> None:
    """Give `module` one parameter per part of packed format `fmt`, shaped
    by `shape_of(rows along the input)`."""
    for part in FORMATS[fmt].parts:
        setattr(module, part.name, nn.Parameter(shape_of(in_features // part.per), part.dtype))


def _stored(module: nn.Module) -> list:
    if module.fmt in ("f32", "f16"):
        return [module.weight]
    return [getattr(module, part.name) for part in FORMATS[module.fmt].parts]


class GPULinear(nn.Module):
    """y = x @ W.T on CUDA, W stored (out, in).

    `fmt` is "f16" or a packed format of `formats.FORMATS`; float32 and other
    unpacked weights are kept as float16. A packed weight keeps its format's
    parts, each (out, in / per).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "f16") -> None:
        self.fmt = fmt if fmt in FORMATS else "f16"
        self.in_features = in_features
        if self.fmt == "f16":
            self.weight = nn.Parameter((out_features, in_features), GPU_DTYPE)
        else:
            _packed_parameters(self, self.fmt, in_features, lambda rows: (out_features, rows))

    def forward(self, x: Tensor, row_tile: int = 1, out_dtype: str = GPU_DTYPE) -> Tensor:
        fmt = self.fmt
        return op.tensor_expr_op(
            lambda xt, *ws: _gpu_matmul(fmt, out_dtype, xt, *ws), "matmul", [x, *_stored(self)]
        )

    def columns(self, ids: Tensor) -> Tensor:
        """W.T[:, ids] as (len(ids), in): rows of the stored weight."""
        if self.fmt == "f16":
            return op.take(self.weight, ids, axis=0)
        fmt, k_extent = self.fmt, self.in_features
        return op.tensor_expr_op(
            lambda it, *ws: _gather_rows(fmt, k_extent, GPU_DTYPE, it, *ws), "take_rows", [ids, *_stored(self)]
        )


def int8_row_tile(isa: str, row_tile: int, fmt: str) -> int:
    """The rows an 8-bit kernel of `fmt` computes together for a caller's
    `row_tile`: one row, a decode batch's tile, or in prefill the widest
    tile the registers hold (`int8_matmul.row_tile`)."""
    if row_tile >= PREFILL_ROW_TILE:
        return int8_matmul.row_tile(isa, fmt)
    return min(row_tile, DECODE_ROW_TILE)


@functools.lru_cache(maxsize=None)
def _quantize_activations(k_extent: int, block: int, group: int):
    return int8_activations.quantize_activations(k_extent, block, group)


@functools.lru_cache(maxsize=None)
def _int8_matmul(fmt: str, k_extent: int, n_extent: int, row_tile: int, isa: str):
    return int8_matmul.packed_matmul(fmt, k_extent, n_extent, row_tile, isa)


class Linear(nn.Module):
    """y = x @ W on the CPU, W stored as column panels (out / panel, in, panel).

    Weights are "f32", "f16" (a `weight`) or a packed format of
    `formats.FORMATS`, whose parts are paneled the same way: (out / panel,
    in / per, panel). With `int8` (an instruction set) a packed weight is
    multiplied by 8-bit activations (`int8_matmul`), in panels of 16.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "f32", int8: str | None = None) -> None:
        self.fmt = fmt
        self.in_features = in_features
        self.out_features = out_features
        self.int8 = int8 if int8 and int8_matmul.runs_int8(fmt, in_features, out_features) else None
        width = int8_matmul.LANES if self.int8 else panel_width(out_features)
        panels = out_features // width
        if self.fmt in ("f32", "f16"):
            dtype = "float16" if self.fmt == "f16" else "float32"
            self.weight = nn.Parameter((panels, in_features, width), dtype)
        elif self.fmt in FORMATS:
            _packed_parameters(self, self.fmt, in_features, lambda rows: (panels, rows, width))
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def forward(self, x: Tensor, row_tile: int = 1, out_dtype: str = DTYPE) -> Tensor:
        fmt, stored = self.fmt, _stored(self)
        if self.int8:
            return self._int8_forward(x, row_tile)
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

    def _int8_forward(self, x: Tensor, row_tile: int) -> Tensor:
        *lead, k = x.shape
        rows = op.reshape(x, (functools.reduce(lambda a, b: a * b, lead), k))
        n = rows.shape[0]
        block, group = int8_matmul.activation_layout(self.fmt, self.int8)
        x8, dx, sums = op.tensor_ir_op(
            _quantize_activations(int(k), block, group),
            "quantize_activations",
            [rows],
            [
                Tensor.placeholder((n, k), "int8"),
                Tensor.placeholder((n, k // block), "float32"),
                Tensor.placeholder((n, k // group), "float32"),
            ],
        )
        out_features = self.out_features
        y = op.tensor_ir_op(
            _int8_matmul(self.fmt, int(k), out_features, int8_row_tile(self.int8, row_tile, self.fmt), self.int8),
            "matmul_int8",
            [x8, dx, sums, *_stored(self)],
            Tensor.placeholder((n, out_features), "float32"),
        )
        return op.reshape(y, (*lead, out_features))

    def columns(self, ids: Tensor) -> Tensor:
        """W[:, ids] as (len(ids), in): the rows of the transposed weight."""
        fmt, k_extent = self.fmt, self.in_features
        return op.tensor_expr_op(
            lambda it, *ws: _panel_columns(fmt, k_extent, it, *ws),
            "take_columns",
            [ids, *_stored(self)],
        )


class SplitLinear(nn.Module):
    """A fused projection (Q/K/V, gate/up) whose source tensors differ in
    format, as one linear per run of equal formats (`part0`, `part1`, …),
    their outputs joined: each part stays packed in its own format rather
    than the whole being widened to a common one."""

    def __init__(self, in_features: int, groups: list[tuple[int, str]], cpu: CPU | None) -> None:
        self.parts = len(groups)
        for i, (out_features, fmt) in enumerate(groups):
            setattr(self, f"part{i}", linear(in_features, out_features, cpu, fmt))

    def forward(self, x: Tensor, row_tile: int = 1, *args) -> Tensor:
        outs = [getattr(self, f"part{i}")(x, row_tile, *args) for i in range(self.parts)]
        return op.concat(outs, dim=-1)


def linear(in_features: int, out_features: int, cpu: CPU | None, fmt: str, parts: tuple[int, ...] = ()):
    """The CPU's paneled `Linear` (`cpu` given) or CUDA's `GPULinear`; a
    fused module (output sizes `parts`) whose tensors differ in format is a
    `SplitLinear`."""
    if "," in fmt:
        return SplitLinear(in_features, split_groups(fmt, parts or (out_features,)), cpu)
    if cpu:
        return Linear(in_features, out_features, fmt, cpu.int8)
    return GPULinear(in_features, out_features, fmt)


def _gather_rows(fmt: str, k_extent: int, dtype: str, ids: te.Tensor, *ws: te.Tensor) -> te.Tensor:
    """Rows `ids` of an (out, in) weight, dequantized into `dtype`."""
    return te.compute(
        (ids.shape[0], k_extent),
        lambda t, k: _value(fmt, ws, lambda w, per: w[ids[t], k // per], k).astype(dtype),
        name="take_rows",
    )


class Embedding(nn.Module):
    """A separate (untied) token embedding table, (vocab, hidden) rows in
    the file's format, f32/f16 or packed (`formats.FORMATS`), gathered and
    dequantized a row per token into `dtype`: a packed table is never
    widened as a whole."""

    def __init__(self, vocab_size: int, hidden_size: int, fmt: str, dtype: str) -> None:
        keeps_f32 = fmt == "f32" and dtype == "float32"
        self.fmt = fmt if fmt in FORMATS or keeps_f32 else "f16"
        self.in_features = hidden_size
        self.dtype = dtype
        if self.fmt in ("f32", "f16"):
            store = "float16" if self.fmt == "f16" else "float32"
            self.weight = nn.Parameter((vocab_size, hidden_size), store)
        else:
            _packed_parameters(self, self.fmt, hidden_size, lambda rows: (vocab_size, rows))

    def forward(self, ids: Tensor) -> Tensor:
        fmt, k_extent, dtype = self.fmt, self.in_features, self.dtype
        return op.tensor_expr_op(
            lambda it, *ws: _gather_rows(fmt, k_extent, dtype, it, *ws), "take_rows", [ids, *_stored(self)]
        )


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
