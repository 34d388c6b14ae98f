"""The AMX weight-only matmul (csrc/woq_amx.cpp): bf16 activations times 4- or 8-bit codes with a float32
scale and min per group, dequantized once per call in 1 KB tiles instead of once per row (`gemm`); for
1-4 rows, AVX512-BF16 dot products on the codes themselves, with the scale and min applied per group
(`gemv`, on the same layout).

This module is the layout's arithmetic; the compiled kernel comes from the op table (ops.py: None without a
compiler, on CPUs without AMX-BF16 or when the OS refuses the tile state) and runs in woq_kernels.py.
The kernel compiles without floating-point contraction: w = s*q + m rounds twice in float32, as
QuantLinear.dequantize_weight() does.
"""

from __future__ import annotations

import torch


def supports(bits: int, in_features: int, out_features: int, group_size: int | None) -> bool:
    group = in_features if group_size is None else group_size
    return bits in (4, 8) and in_features % 32 == 0 and group % 32 == 0 and out_features % 16 == 0


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 32]: each 16 output columns' values for the input pair (2p, 2p+1) in
    TDPBF16PS's B-tile order e = 2n + k % 2."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32)


def from_tile_order(t: torch.Tensor) -> torch.Tensor:
    """tile_order's inverse: [N/16, K/2, 32] -> [N, K]."""
    n16, k2 = t.shape[:2]
    return t.view(n16, k2, 16, 2).permute(0, 2, 1, 3).reshape(n16 * 16, k2 * 2).contiguous()


def pack_codes(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] and scales / mins float32 [N, groups] -> the kernel's layout (csrc/woq_amx.h):
    each 16 output columns' codes in the AMX B-tile order e = 2n + k % 2, scales / mins [N/16, groups, 16]
    in float16 when that holds them exactly (a decode step streams 0.125 B a weight less), else float32."""
    n, k = codes.shape
    e_order = tile_order(codes)
    if bits == 4:
        packed = e_order[..., :16] | (e_order[..., 16:] << 4)
    else:
        packed = e_order
    groups = scales.shape[1]

    def by_subtile(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // 16, 16, groups).transpose(1, 2).contiguous()

    s, m = by_subtile(scales), by_subtile(mins)
    if exact_in_float16(s) and exact_in_float16(m):  # GGUF's blocks: half the bytes, the same values
        s, m = s.half(), m.half()
    return packed.to(torch.uint8).contiguous(), s, m


def exact_in_float16(t: torch.Tensor) -> bool:
    """Whether float16 holds every value of t exactly (GGUF stores its block scales and mins so)."""
    return bool(torch.equal(t.half().float(), t))


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes' codes back to uint8 [N, K] (the inverse permutation)."""
    e_order = torch.cat((packed & 0x0F, packed >> 4), dim=-1) if bits == 4 else packed
    return from_tile_order(e_order)


def rows(
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ids: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unpack_codes / unpack_groups of output rows `ids` only (an embedding lookup from a tied lm_head: a
    decode step reads one row's 16-column subtile, not the whole table)."""
    codes, scales, mins = layout
    sub, col, at = ids // 16, ids % 16, torch.arange(len(ids)).unsqueeze(1)
    e = 2 * col.unsqueeze(1) + torch.arange(2)  # [n, 2]: the row's two places in each pair row (k even, odd)
    if bits == 4:  # e < 16 in the low nibble of byte e, e >= 16 in the high nibble of byte e - 16
        v = codes[sub][at, :, e % 16] >> (4 * (e >= 16)).unsqueeze(-1).to(torch.uint8) & 0x0F
    else:
        v = codes[sub][at, :, e]
    c = v.transpose(1, 2).reshape(len(ids), -1)  # [n, 2, K/2] -> [n, K/2, 2] -> [n, K]
    return c.contiguous(), scales[sub, :, col].float(), mins[sub, :, col].float()


def unpack_groups(t: torch.Tensor) -> torch.Tensor:
    """pack_codes' scales or mins back to float32 [N, groups]."""
    return t.float().transpose(1, 2).reshape(-1, t.shape[1]).contiguous()
