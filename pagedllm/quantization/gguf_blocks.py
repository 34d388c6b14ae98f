"""GGUF block formats -> the affine form QuantLinear stores: codes q, and per group of 32 inputs (16 for Q6_K) a
scale s and a min m with w = s * q + m, in exactly the arithmetic llama.cpp's (and gguf.quants')
dequantization does.

    type   block             what a weight is (ggml-quants.c's dequantize_row_*)      here
    Q4_0   32,  18 B   d * (q - 8)                                            4-bit, s = d, m = -8 d
    Q4_1   32,  20 B   d * q + m                                              4-bit, s = d, m = m
    Q5_0   32,  22 B   d * (q - 16), q 5 bits (the 5th from qh)               8-bit codes 0..31, m = -16 d
    Q5_1   32,  24 B   d * q + m,    q 5 bits                                 8-bit codes 0..31
    Q8_0   32,  34 B   d * q, q int8                                          8-bit, codes q + 128, m = -128 d
    Q4_K   256, 144 B  (d * sc_j) * q - (dmin * m_j), 8 sub-blocks of 32 with  4-bit, s = d sc_j, m = -dmin m_j
                       6-bit sc_j, m_j packed in 12 bytes
    Q5_K   256, 176 B  as Q4_K with 5-bit q (the 5th from qh)                 8-bit codes 0..31
    Q6_K   256, 210 B  (d * sc_j) * (q - 32), q 6 bits (4 from ql, 2 from qh),  8-bit codes 0..63, group 16,
                       16 sub-blocks of 16 with int8 sc_j, d fp16 last         s = d sc_j, m = -32 s

Every s and m above is exact in float32 (an fp16 times an integer below 64: at most 17 significant bits), and
s * q + m then rounds as llama.cpp's d1 * q - m1 does, so QuantLinear.dequantize_weight() equals
gguf.quants.dequantize bit for bit (tests/test_gguf_blocks.py). The K-quants' super-block structure is not
kept in decode()'s float32 scales and mins, but `super_blocks` gives it back (per super-block a float32 d
and dmin, per sub-block an integer code), and the AVX2 kernel's layout keeps that form (4.75 bits a weight
for Q4_K instead of 6). Their values are the file's. The other types (Q2_K, Q3_K, IQ*, ...) are not decoded here: those
tensors are dequantized at load (the loader says so).

Q6_K is the one type with groups of 16 (its sub-blocks), which the AVX2 kernel takes for 8-bit codes. Its
s = d * sc is exact in float32: d has 11 significant bits, sc (int8, |sc| <= 128) at most 7, the product at
most 18 < 24. gguf.quants computes s * (q - 32), q - 32 in -32..31 (at most 5 bits): 23 bits, exact; here
s * q (q 0..63, 6 bits: 24 bits, exact) plus m = -32 s (exact: a power of two) is that same real number,
which float32 holds, so the sum (or an FMA) gives it exactly. Only the sign of a zero may differ
(s * 0 against s * 32 - 32 s = +0), as for Q8_0; np.array_equal and every product treat them as equal.

Nibbles: in a Q4_0/Q4_1/Q5 block byte j holds weight j (low) and j + 16 (high); in a Q4_K/Q5_K super-block
each 32 bytes hold two sub-blocks, the low nibbles the first 32 weights and the high nibbles the next 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# type -> (weights a block, bytes a block, bits of the codes QuantLinear stores, group along the input)
BLOCKS = {
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q5_0": (32, 22, 8, 32),
    "Q5_1": (32, 24, 8, 32),
    "Q8_0": (32, 34, 8, 32),
    "Q4_K": (256, 144, 4, 32),
    "Q5_K": (256, 176, 8, 32),
    "Q6_K": (256, 210, 8, 16),
}
NATIVE_TYPES = tuple(BLOCKS)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as float16 -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] nibbles: low nibbles are weights 0..15, high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's qh (4 bytes, little-endian uint32) -> [..., 32] bits, bit j for weight j."""
    word = np.ascontiguousarray(qh).view("<u4")[..., 0]
    return ((word[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> (sc, m) [..., 8], 6 bits each (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate((s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)), axis=-1)
    m = np.concatenate((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), axis=-1)
    return sc, m


def _q6_k(b: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks [rows, n, 210] -> (codes 0..63 [rows, cols], scales, mins f32 [rows, cols/16]).

    Each half of 128 weights takes 64 bytes of ql and 32 of qh: weight l (0..31) is ql[l]'s low nibble,
    l + 32 ql[l + 32]'s, l + 64 and l + 96 their high nibbles, and the 2 high bits of weight l + 32 i are
    bits 2i, 2i + 1 of qh[l] (ggml's dequantize_row_q6_K)."""
    n = b.shape[1]
    ql = b[..., :128].reshape(rows, n, 2, 1, 64)
    ql = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(rows, n, 2, 4, 32)
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32)
    qh = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [rows, n, half, 4, 32]
    codes = (ql | (qh << 4)).reshape(rows, cols)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [rows, n, 16]
    scales = _f16(b[..., 208:210])[..., None] * sc  # exact (see above)
    return codes, scales.reshape(rows, -1), np.float32(-32) * scales.reshape(rows, -1)


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]):
    """Raw rows of blocks -> (codes uint8 [out, in], scales f32 [out, in/group], mins f32 [out, in/group],
    bits, group): group 32, or 16 for Q6_K (BLOCKS)."""
    rows, cols = shape
    per_block, nbytes, bits, group = BLOCKS[type_name]
    b = np.ascontiguousarray(raw).reshape(rows, cols // per_block, nbytes)
    if type_name == "Q6_K":
        codes, scales, mins = _q6_k(b, rows, cols)
        return codes.astype(np.uint8, copy=False), scales.astype(np.float32, copy=False), mins, bits, group
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = _k_scales_mins(b[..., 4:16])
        scales = d[..., None] * sc.astype(np.float32)  # [rows, super-blocks, 8]: exact in float32
        mins = -(dmin[..., None] * m.astype(np.float32))
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: two sub-blocks each
        codes = np.stack((qs & 0x0F, qs >> 4), axis=3)  # [rows, sb, chunk, low/high, 32]
        if type_name == "Q5_K":
            qh = b[..., 16:48]  # bit 2j of byte l: weight l of sub-block 2j; bit 2j + 1: of sub-block 2j + 1
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            codes = codes | (((qh[:, :, None, None, :] >> shifts) & 1) << 4)
        return (
            codes.reshape(rows, cols).astype(np.uint8, copy=False),
            scales.reshape(rows, -1).astype(np.float32, copy=False),
            mins.reshape(rows, -1).astype(np.float32, copy=False),
            bits,
            group,
        )
    d = _f16(b[..., 0:2])
    if type_name == "Q8_0":
        codes = b[..., 2:] ^ np.uint8(0x80)  # int8 q + 128 as a byte: the sign bit flipped
        mins = -128 * d
    elif type_name == "Q4_0":
        codes, mins = _low_high(b[..., 2:]), -8 * d
    elif type_name == "Q4_1":
        codes, mins = _low_high(b[..., 4:]), _f16(b[..., 2:4])
    elif type_name == "Q5_0":
        codes, mins = _low_high(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4), -16 * d
    else:  # Q5_1
        codes, mins = _low_high(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4), _f16(b[..., 2:4])
    return (
        codes.reshape(rows, cols).astype(np.uint8, copy=False),
        d,
        mins.astype(np.float32, copy=False),
        bits,
        group,
    )


@dataclass
class SuperBlocks:
    """Scales and mins factored as GGUF's K-quants store them (gguf_blocks.super_blocks): per super-block of
    `groups` groups a float32 super-scale, per group an int8 code, with scales = d * scale_codes and mins =
    dmin * min_codes exactly. A kernel whose layout keeps this form streams fewer bytes a weight."""

    groups: int
    d: torch.Tensor  # float32 [out, super-blocks]
    scale_codes: torch.Tensor  # int8 [out, groups in total]
    dmin: torch.Tensor
    min_codes: torch.Tensor

    @staticmethod
    def cat(parts: list[SuperBlocks | None]) -> SuperBlocks | None:
        """The parts' rows stacked (QuantLinear.concat), or None unless every part has the same form."""
        if any(p is None for p in parts) or len({p.groups for p in parts}) != 1:
            return None
        fields = ("d", "scale_codes", "dmin", "min_codes")
        return SuperBlocks(parts[0].groups, *(torch.cat([getattr(p, f) for p in parts]) for f in fields))


def super_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> SuperBlocks | None:
    """A K-quant's scales and mins as the file factors them (None for the other types): decode()'s scales
    are d * scale codes and its mins dmin * min codes, both products exact in float32 and computed the same
    way, so equal bit for bit."""
    if type_name not in K_QUANTS:
        return None
    rows, cols = shape
    per_block, nbytes, _, group = BLOCKS[type_name]
    b = np.ascontiguousarray(raw).reshape(rows, cols // per_block, nbytes)
    if type_name == "Q6_K":  # m = -32 s: the same codes, super-scale -32 d (exact: a power of two)
        d = _f16(b[..., 208:210])
        sc = b[..., 192:208].view(np.int8).reshape(rows, -1)
        parts = (d, sc, np.float32(-32) * d, sc)
    else:
        sc, m = _k_scales_mins(b[..., 4:16])  # 6 bits each: 0..63 fits int8
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        parts = (d, sc.reshape(rows, -1).astype(np.int8), -dmin, m.reshape(rows, -1).astype(np.int8))
    return SuperBlocks(per_block // group, *(torch.from_numpy(np.ascontiguousarray(p)) for p in parts))
