"""Repacking GGML blocks at load into the parts a `formats.WeightFormat`
keeps (numpy, once per weight): the bit orders are those `formats`'
docstring gives, which the kernels read. One `pack_<type>(blocks, rows,
cols)` per packed type returns its parts by name."""

from __future__ import annotations

import numpy as np


def _f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """A float16 field of every block, (rows, blocks)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]


def _positions(bits_per_code: int, group: int) -> np.ndarray:
    """The bit where each of `group` consecutive codes starts in their word
    (the orders the module's docstring gives)."""
    k = np.arange(group)
    low = k % 4 * 8
    if bits_per_code == 4:
        return (low + k % 8 // 4 * 4).astype(np.uint32)
    if bits_per_code == 1:
        return (low + k // 8 * 2 + k % 8 // 4).astype(np.uint32)
    return (low + (k // 8 * 2 + k % 8 // 4) * 2).astype(np.uint32)


def nibble_words(codes: np.ndarray) -> np.ndarray:
    """(rows, cols) codes below 16 -> (rows, cols / 8) uint32 words."""
    rows, cols = codes.shape
    shifts = _positions(4, 8)
    return np.bitwise_or.reduce(
        (codes.reshape(rows, cols // 8, 8).astype(np.uint32) & 15) << shifts, axis=-1
    )


def _two_bit_words(bits: np.ndarray) -> np.ndarray:
    """(rows, cols) values below 4 -> (rows, cols / 16) uint32 words."""
    rows, cols = bits.shape
    shifts = _positions(2, 16)
    return np.bitwise_or.reduce(
        bits.reshape(rows, cols // 16, 16).astype(np.uint32) << shifts, axis=-1
    )


def _one_bit_words(bits: np.ndarray) -> np.ndarray:
    """(rows, cols) bits -> (rows, cols / 32) uint32 words."""
    rows, cols = bits.shape
    shifts = _positions(1, 32)
    return np.bitwise_or.reduce(
        bits.reshape(rows, cols // 32, 32).astype(np.uint32) << shifts, axis=-1
    )


def _block_nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-input block's 16 code bytes -> its 32 codes: input j is the low
    nibble of byte j, input j + 16 the high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def pack_q8_0(blocks, rows, cols):
    return {
        "codes": np.ascontiguousarray(blocks[..., 2:]).reshape(rows, cols).view("<i4"),
        "scales": _f16_field(blocks, 0),
    }


def pack_q4_0(blocks, rows, cols):
    return {
        "codes": nibble_words(_block_nibbles(blocks[..., 2:]).reshape(rows, cols)),
        "scales": _f16_field(blocks, 0),
    }


def pack_q4_1(blocks, rows, cols):
    return {
        "codes": nibble_words(_block_nibbles(blocks[..., 4:]).reshape(rows, cols)),
        "scales": _f16_field(blocks, 0),
        "mins": _f16_field(blocks, 2),
    }


def _qh_words(blocks: np.ndarray, at: int) -> np.ndarray:
    # GGML's qh: bit j of the little-endian word is input j's fifth bit
    qh = blocks[..., at : at + 4].copy().view("<u4")[..., 0]
    rows, n_blocks = qh.shape
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return _one_bit_words(bits.reshape(rows, n_blocks * 32))


def pack_q5_0(blocks, rows, cols):
    return {
        "codes": nibble_words(_block_nibbles(blocks[..., 6:]).reshape(rows, cols)),
        "high": _qh_words(blocks, 2),
        "scales": _f16_field(blocks, 0),
    }


def pack_q5_1(blocks, rows, cols):
    return {
        "codes": nibble_words(_block_nibbles(blocks[..., 8:]).reshape(rows, cols)),
        "high": _qh_words(blocks, 4),
        "scales": _f16_field(blocks, 0),
        "mins": _f16_field(blocks, 2),
    }


def k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block, from its
    12 bytes (…, 12) -> two (…, 8) uint8 arrays (GGML's `get_scale_min_k4`)."""
    q = packed.astype(np.uint8)
    low, mid, top = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = np.concatenate([low & 63, (top & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A Q4_K/Q5_K super-block's 128 code bytes -> its 256 low nibbles: in
    each 64 inputs, the 32 low nibbles of 32 bytes, then their high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _pack_k_common(blocks, rows, cols, codes_at):
    scales, mins = k_scales_and_mins(blocks[..., 4:16])
    return {
        "codes": nibble_words(_k_nibbles(blocks[..., codes_at : codes_at + 128]).reshape(rows, cols)),
        "sub_scales": scales.reshape(rows, cols // 32),
        "sub_mins": mins.reshape(rows, cols // 32),
        "super_scales": _f16_field(blocks, 0),
        "super_mins": _f16_field(blocks, 2),
    }


def pack_q4_k(blocks, rows, cols):
    return _pack_k_common(blocks, rows, cols, 16)


def pack_q5_k(blocks, rows, cols):
    out = _pack_k_common(blocks, rows, cols, 48)
    # qh byte l holds, in bit 2c, the fifth bit of input 64c + l and, in bit
    # 2c + 1, that of input 64c + 32 + l
    qh = blocks[..., 16:48]
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (…, 8, 32)
    out["high"] = _one_bit_words(bits.reshape(rows, cols))
    return out


def pack_q6_k(blocks, rows, cols):
    # block: ql[128], qh[64], int8 scales[16], f16 d; each half of 128
    # inputs takes 64 bytes of ql and 32 of qh: input 32g + l of the half
    # is nibble (g >= 2) of ql[32·(g % 2) + l] with bits 2g..2g+1 of qh[l]
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 2, 32)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # (…, 2 halves, 4 groups, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return {
        "codes": nibble_words(low.reshape(rows, cols)),
        "high": _two_bit_words(high.reshape(rows, cols)),
        "sub_scales": blocks[..., 192:208].view(np.int8).reshape(rows, cols // 16),
        "super_scales": _f16_field(blocks, 208),
    }
