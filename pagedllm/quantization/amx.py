"""The AMX weight-only matmul (csrc/woq_amx.cpp): bf16 activations times 4- or 8-bit codes with a scale
and min per group (float32 values, kept in the smallest exact form: pack_codes), dequantized once per call
in 1 KB tiles instead of once per row (`gemm`); for 1-8 rows, AVX512-VNNI int8 dot products on the codes
themselves, with the scale and min applied per group (`gemv`, on the same layout).

This module is the layout's arithmetic; the compiled kernel comes from the op table (ops.py: None without a
compiler, on CPUs without AMX-BF16 or when the OS refuses the tile state) and runs in woq_kernels.py.
The kernel compiles without floating-point contraction: w = s*q + m rounds twice in float32, as
QuantLinear.dequantize_weight() does (one FMA only where s*q is exact, so the same rounding).
"""

from __future__ import annotations

import torch

from pagedllm.quantization.gguf_blocks import SuperBlocks
from pagedllm.quantization.scale_forms import exact_in_float16, factors, min_factor_of


def supports(bits: int, in_features: int, out_features: int, group_size: int | None) -> bool:
    group = in_features if group_size is None else group_size
    return bits in (4, 8) and in_features % 32 == 0 and group % 32 == 0 and out_features % 16 == 0


def tile_order(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] -> int16 [N/16, K/2, 16]: each 16 output columns' codes for the input pair (2p, 2p+1), one
    int16 a column (the two bytes in k order), so their bytes are TDPBF16PS's B-tile order e = 2n + k % 2.
    Moving pairs as int16 makes the transpose a plain 2-byte one (3x the speed of permuting bytes)."""
    n, k = codes.shape
    return codes.contiguous().view(torch.int16).view(n // 16, 16, k // 2).transpose(1, 2).contiguous()


def from_tile_order(pairs: torch.Tensor) -> torch.Tensor:
    """tile_order's inverse: int16 [N/16, K/2, 16] -> uint8 [N, K]."""
    n16, k2 = pairs.shape[:2]
    return pairs.transpose(1, 2).reshape(n16 * 16, k2).contiguous().view(torch.uint8)


def pack_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    superblocks: SuperBlocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] and scales / mins float32 [N, groups] -> the kernel's layout (csrc/woq_amx.h):
    each 16 output columns' codes in the AMX B-tile order e = 2n + k % 2, and the scales and mins in the
    smallest form that holds them exactly (scale_forms.py; a single-stream decode streams them with the codes):
    mins derived from float16 scales (GGUF's Q4_0, Q8_0: only the factor c, a one-element float32 tensor;
    0.5 bits a weight), two-level where `superblocks` factor them (GGUF's K-quants: uint8
    [N/16, groups / sb, 32 + 16 sb], per super-block the 16 columns' float16 d, then sb groups x 16 int8 codes;
    0.625 bits a weight for both), float16 [N/16, groups, 16] each, else float32 (2 bits a weight)."""
    n, k = codes.shape
    pairs = tile_order(codes.to(torch.uint8))
    if bits == 4:  # byte e < 16 takes e's code low and e + 16's high: as int16, column n's pair and n + 8's
        pairs = pairs[..., :8] | (pairs[..., 8:] << 4)  # (codes < 16: no bit crosses into the next byte)
    packed = pairs.view(torch.uint8).contiguous()
    groups = scales.shape[1]

    def by_subtile(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // 16, 16, -1).transpose(1, 2).contiguous()

    s, m = by_subtile(scales), by_subtile(mins)
    factor = min_factor_of(scales, mins)
    if factor is not None and exact_in_float16(s):
        return packed, s.half(), torch.tensor([float(factor)])
    if superblocks is not None and factors(superblocks, scales, mins):
        sb = superblocks.groups

        def two_level(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            d_bytes = by_subtile(d).half().view(torch.uint8)  # [N/16, S, 32]
            q_bytes = by_subtile(q).to(torch.int8).view(torch.uint8).reshape(n // 16, groups // sb, sb * 16)
            return torch.cat((d_bytes, q_bytes), dim=2).contiguous()

        return (
            packed,
            two_level(superblocks.d, superblocks.scale_codes),
            two_level(superblocks.dmin, superblocks.min_codes),
        )
    if exact_in_float16(s) and exact_in_float16(m):  # GGUF's blocks: half the bytes, the same values
        s, m = s.half(), m.half()
    return packed, s, m


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes' codes back to uint8 [N, K] (the inverse permutation)."""
    pairs = packed.contiguous().view(torch.int16)
    if bits == 4:  # the low nibbles are columns 0-7's pairs, the high ones 8-15's
        pairs = torch.cat((pairs & 0x0F0F, (pairs >> 4) & 0x0F0F), dim=-1)
    return from_tile_order(pairs)


def rows(
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ids: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unpack_codes / unpack_scales_mins of output rows `ids` only (an embedding lookup from a tied lm_head: a
    decode step reads one row's 16-column subtile, not the whole table)."""
    codes, scales, mins = layout
    sub, col, at = ids // 16, ids % 16, torch.arange(len(ids)).unsqueeze(1)
    e = 2 * col.unsqueeze(1) + torch.arange(2)  # [n, 2]: the row's two places in each pair row (k even, odd)
    if bits == 4:  # e < 16 in the low nibble of byte e, e >= 16 in the high nibble of byte e - 16
        v = codes[sub][at, :, e % 16] >> (4 * (e >= 16)).unsqueeze(-1).to(torch.uint8) & 0x0F
    else:
        v = codes[sub][at, :, e]
    c = v.transpose(1, 2).reshape(len(ids), -1)  # [n, 2, K/2] -> [n, K/2, 2] -> [n, K]
    s = _subtile_groups(scales[sub])[at[:, 0], :, col]
    m = s * float(mins) if mins.numel() == 1 else _subtile_groups(mins[sub])[at[:, 0], :, col]
    return c.contiguous(), s, m


def _subtile_groups(t: torch.Tensor) -> torch.Tensor:
    """Flat or two-level scales / mins of some subtiles [..] -> float32 [.., groups, 16]: d x code for the
    two-level form, as the kernel computes it (exact)."""
    if t.dtype != torch.uint8:
        return t.float()
    d, q = _split_two_level(t)
    return (d.unsqueeze(-2) * q.float().unflatten(-1, (-1, 16))).flatten(-3, -2)


def _split_two_level(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level bytes [.., S, 32 + 16 sb] -> (d float32 [.., S, 16], codes int8 [.., S, sb * 16])."""
    return t[..., :32].contiguous().view(torch.float16).float(), t[..., 32:].contiguous().view(torch.int8)


def unpack_scales_mins(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_codes' scales and mins back to float32 [N, groups] each (derived mins: c x the scales)."""

    def columns(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()

    s = _subtile_groups(scales)
    m = s * float(mins) if mins.numel() == 1 else _subtile_groups(mins)
    return columns(s), columns(m)


def superblocks(layout: tuple[torch.Tensor, ...]) -> SuperBlocks | None:
    """The SuperBlocks a two-level layout was packed from, or None for the other forms."""
    _, s, m = layout
    if s.dtype != torch.uint8:
        return None
    sb = (s.shape[2] - 32) // 16

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, q = _split_two_level(t)
        q = q.reshape(t.shape[0], -1, 16)  # [N/16, S * sb, 16]
        return d.transpose(1, 2).reshape(-1, d.shape[1]), q.transpose(1, 2).reshape(-1, q.shape[1])

    (d, sq), (dmin, mq) = split(s), split(m)
    return SuperBlocks(sb, d.contiguous(), sq.contiguous(), dmin.contiguous(), mq.contiguous())
