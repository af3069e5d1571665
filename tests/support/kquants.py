"""A plain quantizer for GGML's K-quant blocks (Q4_K, Q5_K, Q6_K), which
gguf-py reads but cannot write: tests write small K-quant models with it;
and random blocks of any packed format (`random_blocks`), for the kernels'
tests and `benchmarks/int8_kernels.py`.

The rounding is the simple kind (per-sub-block range, then 6- or 8-bit
sub-scales of one super-block scale), not llama.cpp's searched one; what
matters to the tests is that the blocks are valid and the values they stand
for are defined by GGML's own dequantization, which gguf-py implements
independently of lockgate (`test_quantizer_round_trips` checks the layouts
against it).
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _pack_scales_k4(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> GGML's 12 bytes (inverse of
    `get_scale_min_k4`)."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([low, mid, top], axis=-1)


def _affine_k(w: np.ndarray, levels: int):
    """Super-blocks of 256 as 8 sub-blocks of value d·sc·q − dmin·m with
    q < levels: returns (q, sc, m, d, dmin)."""
    sub = w.reshape(*w.shape[:-1], 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    step = np.maximum((hi - lo) / (levels - 1), 1e-8)
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 1e-8)[..., None]
    dmin32 = dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(step / d32), 1, 63)
    m = np.clip(np.rint(-lo / np.maximum(dmin32, 1e-8)), 0, 63) * (dmin32 > 0)
    scale = (d32 * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin32 * m)[..., None]) / scale), 0, levels - 1).astype(np.uint8)
    return q.reshape(w.shape), sc, m, d, dmin


def _k_low_nibble_bytes(q: np.ndarray) -> np.ndarray:
    """256 codes' low nibbles -> 128 bytes: each 64 codes as 32 bytes, the
    first 32 in the low nibbles, the next 32 in the high."""
    chunks = (q & 15).reshape(*q.shape[:-1], 4, 2, 32)
    return (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(*q.shape[:-1], 128)


def _q4_k(w: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine_k(w, 16)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), _k_low_nibble_bytes(q)], axis=-1
    )


def _q5_k(w: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine_k(w, 32)
    # qh byte l: bit 2c is the fifth bit of code 64c + l, bit 2c + 1 that of 64c + 32 + l
    fifth = (q >> 4).reshape(*q.shape[:-1], 8, 32)
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[:, None], axis=-2)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), qh, _k_low_nibble_bytes(q)], axis=-1
    )


def _q6_k(w: np.ndarray) -> np.ndarray:
    sub = w.reshape(*w.shape[:-1], 16, 16)
    amax = np.abs(sub).max(axis=-1)
    step = np.maximum(amax / 31, 1e-8)
    d = (step.max(axis=-1) / 127).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 1e-8)[..., None]
    sc = np.clip(np.rint(step / d32), 1, 127).astype(np.int8)
    scale = (d32 * sc)[..., None]
    q = (np.clip(np.rint(sub / scale), -32, 31) + 32).astype(np.uint8).reshape(w.shape)
    # each half of 128: code 32g + l is nibble (g >= 2) of ql[32·(g % 2) + l]
    # with its top two bits in bits 2g..2g+1 of qh[l]
    halves = q.reshape(*q.shape[:-1], 2, 4, 32)
    ql = (halves[..., 0:2, :] & 15) | ((halves[..., 2:4, :] & 15) << 4)
    top = halves >> 4
    qh = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return np.concatenate(
        [
            ql.reshape(*q.shape[:-1], 128),
            qh.reshape(*q.shape[:-1], 64),
            sc.view(np.uint8),
            _f16_bytes(d),
        ],
        axis=-1,
    )


_QUANTIZERS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}

K_TYPES = tuple(_QUANTIZERS)


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """An (out, in) float matrix, in == 0 mod 256, as GGML blocks: a
    (out, in / 256 · block bytes) uint8 array for `GGUFWriter.add_tensor`."""
    rows, cols = w.shape
    if cols % 256:
        raise ValueError(f"K-quant rows must be multiples of 256, not {cols}")
    blocks = _QUANTIZERS[qtype](np.asarray(w, dtype=np.float32).reshape(rows, cols // 256, 256))
    return np.ascontiguousarray(blocks.reshape(rows, -1).astype(np.uint8))


#: where each format's float16 fields sit in a block (random bytes there
#: would make infinities and NaNs, which no real file holds)
F16_FIELDS = {
    "q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2],
    "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
}


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random GGML blocks of `fmt` (a name in lockgate's
    `formats.FORMATS`) for an (rows, cols) matrix, uint8: every code and
    bit pattern, finite scales."""
    from lockgate.plugins.tvm.formats import FORMATS

    spec = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    _, block_bytes = gguf.GGML_QUANT_SIZES[spec.ggml_type]
    raw = rng.integers(0, 256, size=(rows, cols // spec.block, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[fmt]:
        scales = rng.uniform(-2, 2, size=(rows, cols // spec.block)).astype(np.float16)
        raw[..., at : at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
