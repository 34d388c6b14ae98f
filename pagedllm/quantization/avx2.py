"""The AVX2 weight-only quantized matmul (csrc/woq_avx2.h): 4- or 8-bit codes with a scale and min per
group, times activations quantized on the fly to int8 per 32-block, on VPMADDUBSW integer dot products.
The kernel for every x86 CPU with AVX2 + FMA + F16C and no AMX.

    layout = pack(codes, scales, mins, bits)          # once, at load (the stored copy can then go:
    codes, scales, mins = unpack(layout, bits, N, K, group_size)   # gives it back bit for bit)
    y = matmul(x, layout, bias, bits, group_size, N)  # x [M, K] float32 / bf16 -> y [M, N], same dtype

Groups: multiples of 32 inputs (or per channel), and 16 for 8-bit codes (GGUF Q6_K's sub-blocks): then
each 32-block's integer dot product and code sum are taken per 16-half, each half with its own scale and min.

Accuracy: that of rounding x to int8 per 32 elements (csrc/woq_avx2.h states the contract, group 16
included); everything after it is exact in int32 or float32. GGUF Q4_K's and Q6_K's two-level layouts round x
per 256-input super-block instead where the build has no pairs kernel (avx2 and avx512 tiers: llama.cpp's Q8_K
activations), so a super-block's groups add up in int32 and the float work is paid once per 256 (x_span).

Measured (scripts/bench_woq_avx2.py: the default model's 120 decoder linears + lm_head, 98.2 MB of layout;
this 2-core Zen 3 VM shared with other jobs at load average 4-7, so on one thread by CPU time, median of 5):
    M=1     cold 7.5 ms (13.1 GB/s: the single-thread read speed measured beside it was 12-15 GB/s) vs
            F.linear on the dequantized float32 weight 46 ms; the float32-activation gemv 11.2 ms
    M=8     27.8 ms vs 106.8 ms (3.8x)      M=32    90.7 ms vs 201 ms (2.2x)
    M=256   776 ms vs 1001 ms (1.29x)       M=1024  3247 ms vs 4155 ms (1.28x)
Above ~32 rows MKL's float32 GEMM runs near its peak while VPMADDUBSW (no VNNI on AVX2) needs an add per
32 products plus the scale and min per 32-block (csrc/woq_avx2.h: ~135 GFLOP/s a core for Q4_1 shapes,
~100 for Q8_0, against MKL's ~70-80).
Group 16 (Q6_K), one [2048 out, 8192 in] layer, one thread, CPU time, median, interleaved with Q8_0 on the
same shape: M=1 ~820 us (25.2 MB: float32 scale and min per 16 weights, 1.5 B a weight) vs Q8_0 ~650 us
(18.9 MB, 1.125 B a weight), both ~30 GB/s, so the extra time is the extra bytes; M=32 98 vs 94 GFLOP/s.
Q6_K's two-level layout with x per super-block (panel_kernel_q6_span) against x per 32-block, the same
[2048, 8192] layer alternated, 2 of 3 rounds (the first ran 2x low in both) on an AMX Xeon capped at avx2:
M=4 106-110 vs 73-76 GOP/s, M=32 114-120 vs 74-83 (1.45x), M=1 50-55 vs 42-47; Q4_K's beside it 115-123.

The compiled module comes from the op table (ops.kernel("quantized_linear", "woq_avx2")): None below the
avx2 tier, without a compiler, or with PAGEDLLM_NO_CPU_KERNEL=1; QuantLinear then runs another kernel
(woq_kernels.py) or the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm import ops
from pagedllm.quantization.gguf_blocks import SuperBlocks
from pagedllm.quantization.scale_forms import exact_in_float16, factors, min_factor_of

SOURCE = Path(__file__).parent / "csrc" / "woq_avx2.cpp"
COLS = 8  # output columns a panel (N is padded to a multiple)
BLOCK = 32  # inputs an activation block; K and every group size but HALF_GROUP are multiples
HALF_GROUP = 16  # the one smaller group, for 8-bit codes only (GGUF Q6_K): half an activation block


def supports(bits: int, in_features: int, out_features: int, group_size: int | None) -> bool:
    """Whether the kernel takes this layer (group_size None: one group a row, per channel)."""
    group = in_features if group_size is None else group_size
    return (
        bits in (4, 8)
        and in_features > 0
        and out_features > 0
        and in_features % BLOCK == 0
        and group > 0
        and (group % BLOCK == 0 or (bits == 8 and group == HALF_GROUP))
        and in_features % group == 0
    )


def _by_panel(t: torch.Tensor, panels: int) -> torch.Tensor:
    """[N, G] -> [panels, G, 8], the padding columns zero."""
    n, g = t.shape
    padded = torch.zeros(panels * COLS, g, dtype=torch.float32)
    padded[:n] = t
    return padded.view(panels, COLS, g).transpose(1, 2).contiguous()


def layout_bits(layout: tuple[torch.Tensor, ...]) -> int:
    """The bits a code takes in the layout: 4, 8, or 6 where pack kept GGUF Q6_K's codes in 6 bits."""
    return layout[0].shape[2] // 32


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    superblocks: SuperBlocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0..2^bits-1), scales / mins float32 [N, G] (G = K / group: K/16 for group 16)
    -> (codes, scales, mins) in the kernel's layout (csrc/woq_avx2.h): codes uint8 [panels, K/32, 128 (4-bit)
    | 256 (8-bit)], each panel of 8 output columns interleaved 4 inputs a column; scales / mins in the
    smallest form that holds them exactly: [panels, G, 8] float16 (GGUF's Q4_0 / Q8_0 ...: 0.25 B a weight
    less to stream at decode than float32), two-level uint8 [panels, G / sb, 16 + 8 sb] where `superblocks`
    (GGUF's K-quants) factors them, else float32. Where every min is one power of two c times its scale
    (GGUF's symmetric types: Q4_0 -8, Q5_0 -16, Q6_K -32, Q8_0 -128) no mins are kept, only c as a
    one-element float32 tensor: the kernel derives them (0.0625 B a weight less to stream for Q4_0)."""
    if bits not in (4, 8):
        raise ValueError(f"avx2.pack: bits must be 4 or 8, got {bits}")
    n, k = codes.shape
    if k % BLOCK or scales.shape != mins.shape or scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(f"avx2.pack: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit")
    panels = -(-n // COLS)
    factor = min_factor_of(scales, mins)
    if bits == 8 and scales.shape[1] * HALF_GROUP == k and int(codes.max()) < 64 and factor == -32:
        bits = 6  # GGUF Q6_K: its 6-bit codes in 6 bits (csrc/woq_avx2.h's panel_kernel_q6)
    c = torch.zeros(panels * COLS, k, dtype=torch.uint8)
    c[:n] = codes
    # [panel, column, block, quad, i] -> [panel, block, quad, column, i]: byte 4c + i of quad j's vector
    c = c.view(panels, COLS, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:
        c = c[:, :, :4] | (c[:, :, 4:] << 4)  # vector v: low nibble k = 4v + i, high nibble k = 16 + 4v + i
    elif bits == 6:  # the 4-bit vectors of the low nibbles, then two planes of the top 2 bits
        low = c & 0x0F
        top = c >> 4  # [panel, block, quad j = 4h + t, column, i]: bits 2t of plane h
        planes = sum(top[:, :, t::4] << (2 * t) for t in range(4))  # [panel, block, h, column, i]
        c = torch.cat((low[:, :, :4] | (low[:, :, 4:] << 4), planes.to(torch.uint8)), dim=2)
    else:
        c = c ^ 0x80  # q - 128 as int8's bit pattern
    c = c.reshape(panels, k // BLOCK, bits * 32).contiguous()
    derived = None if factor is None else torch.tensor([float(factor)])
    if superblocks is not None and factors(superblocks, scales, mins, with_mins=derived is None):  # smallest
        sb = superblocks.groups
        s = _two_level(superblocks.d, superblocks.scale_codes, sb, panels)
        if derived is not None:
            return c, s, derived
        return c, s, _two_level(superblocks.dmin, superblocks.min_codes, sb, panels)
    s, m = _by_panel(scales.float(), panels), _by_panel(mins.float(), panels)
    if exact_in_float16(s) and (derived is not None or exact_in_float16(m)):
        s, m = s.half(), m.half()
    return c, s, derived if derived is not None else m


def min_factor(layout: tuple[torch.Tensor, ...]) -> float | None:
    """The c of a layout that keeps its mins as c x its scales (one float32 element), or None."""
    m = layout[2]
    return float(m) if m.numel() == 1 else None


def _mins(layout: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The layout's mins tensor in the scales' form, derived (c x the scales) where only c is kept.
    Two-level: the super-scales times c (a power of two: exact), the same int8 codes."""
    _, s, m = layout
    c = min_factor(layout)
    if c is None:
        return m
    if s.dtype != torch.uint8:
        return (c * s.float()).to(s.dtype)
    d = (s[..., :16].contiguous().view(torch.float16).float() * c).half()
    return torch.cat((d.view(torch.uint8), s[..., 16:]), dim=-1)


def _two_level(d: torch.Tensor, q: torch.Tensor, sb: int, panels: int) -> torch.Tensor:
    """d [N, S] (exact in float16), q int8 [N, S * sb] -> uint8 [panels, S, 16 + 8 sb]: per super-block the
    8 columns' d (float16 bytes, as GGUF stores it), then sb groups x 8 columns of int8 codes
    (csrc/woq_avx2.h's TwoLevelScales)."""
    d_p = _by_panel(d.float(), panels).half()  # [panels, S, 8]
    q_p = _by_panel(q.float(), panels).to(torch.int8)  # [panels, S * sb, 8]
    supers = d_p.shape[1]
    d_bytes = d_p.contiguous().view(torch.uint8)  # [panels, S, 16]
    q_bytes = q_p.view(torch.uint8).reshape(panels, supers, sb * COLS)
    return torch.cat((d_bytes, q_bytes), dim=2).contiguous()


def _split_two_level(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_two_level's bytes -> (d float32 [panels, S, 8], q float32 [panels, S * sb, 8])."""
    panels, supers, width = t.shape
    d = t[..., :16].contiguous().view(torch.float16).float()
    q = t[..., 16:].contiguous().view(torch.int8).reshape(panels, supers * ((width - 16) // COLS), COLS)
    return d, q.float()


def _columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """[panels, G, 8] -> [n, G] float32 (the padding columns dropped)."""
    panels = t.shape[0]
    return t.float().transpose(1, 2).reshape(panels * COLS, -1)[:n].contiguous()


def superblocks(layout: tuple[torch.Tensor, ...], out_features: int) -> SuperBlocks | None:
    """The SuperBlocks a two-level layout was packed from, or None for the other forms."""
    _, s, m = layout
    if s.dtype != torch.uint8:
        return None
    m = _mins(layout)
    (sd, sq), (md, mq) = _split_two_level(s), _split_two_level(m)
    groups = sq.shape[1] // sd.shape[1]
    int8 = [_columns(t, out_features).to(torch.int8) for t in (sq, mq)]
    return SuperBlocks(groups, _columns(sd, out_features), int8[0], _columns(md, out_features), int8[1])


def unpack(
    layout: tuple[torch.Tensor, ...], bits: int, out_features: int, in_features: int, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's layout back to (codes uint8 [N, K], scales float32 [N, G], mins float32 [N, G]) exactly."""
    codes, s, m = layout
    panels, blocks = codes.shape[:2]
    bits = layout_bits(layout)
    if bits == 4:
        c = codes.view(panels, blocks, 4, COLS, 4)
        c = torch.cat((c & 0x0F, c >> 4), dim=2)  # quads 0..3, then 4..7
    elif bits == 6:
        c = codes.view(panels, blocks, 6, COLS, 4)
        low = torch.cat((c[:, :, :4] & 0x0F, c[:, :, :4] >> 4), dim=2)  # quads 0..7
        planes = c[:, :, 4:6]  # [.., h, ..]: quad 4h + t's top bits at 2t
        top = torch.stack([(planes >> (2 * t)) & 0x03 for t in range(4)], dim=3)  # [.., h, t, column, i]
        c = low | (top.reshape(panels, blocks, 8, COLS, 4) << 4)
    else:
        c = (codes ^ 0x80).view(panels, blocks, 8, COLS, 4)
    c = c.permute(0, 3, 1, 2, 4).reshape(panels * COLS, in_features)[:out_features].contiguous()

    def groups(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:  # two-level: d * code, as the kernel computes it
            d, q = _split_two_level(t)
            t = d.repeat_interleave(q.shape[1] // d.shape[1], dim=1) * q
        return _columns(t, out_features)

    scales, factor = groups(s), min_factor(layout)
    return c, scales, groups(m) if factor is None else factor * scales  # derived mins: c x the scales


def rows(
    layout: tuple[torch.Tensor, ...], ids: torch.Tensor, bits: int, in_features: int, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unpack() of output rows `ids` only, read straight from their panels' column (a decode step's
    embedding lookup: one row, a few small ops, not a panel's 8 rows through unpack)."""
    codes, s, m = layout
    bits, n, blocks = layout_bits(layout), len(ids), codes.shape[1]
    panel, col, at = ids // COLS, ids % COLS, torch.arange(len(ids))
    v = codes[panel].view(n, blocks, bits, COLS, 4)[at, :, :, col]  # [n, block, vector, i]
    if bits == 8:
        c = v ^ 0x80
    else:  # the nibble vectors: low nibbles quads 0..3, high ones 4..7 (k = 4 quad + i)
        c = torch.cat((v[:, :, :4] & 0x0F, v[:, :, :4] >> 4), dim=2)
        if bits == 6:  # plane h's bits 2t, 2t + 1: quad 4h + t's top two
            top = torch.stack([(v[:, :, 4:6] >> (2 * t)) & 0x03 for t in range(4)], dim=3)
            c = c | (top.reshape(n, blocks, 8, 4) << 4)
    c = c.reshape(n, in_features)

    def groups(t: torch.Tensor) -> torch.Tensor:
        t = t[panel]
        if t.dtype != torch.uint8:
            return t[at, :, col].float()
        d, q = _split_two_level(t)  # two-level: d * code, as the kernel computes it
        d, q = d[at, :, col], q[at, :, col]
        return d.repeat_interleave(q.shape[1] // d.shape[1], dim=1) * q

    scales, factor = groups(s), min_factor(layout)
    return c, scales, groups(m) if factor is None else factor * scales  # derived mins: c x the scales


def x_span(layout: tuple[torch.Tensor, ...]) -> int:
    """The inputs over which the kernel rounds x to int8 for this layout: a K-quant super-block (256) for
    GGUF Q4_K's and Q6_K's two-level layouts where this build runs panel_kernel_span / panel_kernel_q6_span
    (llama.cpp's Q8_K activations), else a 32-block (csrc/woq_avx2.h states both contracts)."""
    ext = ops.kernel("quantized_linear", "woq_avx2")
    _, s, _ = layout
    bits = layout_bits(layout)
    if ext is None or s.dtype != torch.uint8:
        return BLOCK
    inputs = (s.shape[2] - 16) // COLS * (HALF_GROUP if bits == 6 else BLOCK)  # a super-block's
    k_quant = inputs == 256 and (bits == 6 or (bits == 4 and min_factor(layout) is None))
    return ext.k_quant_x_span(bits) if k_quant else BLOCK


def matmul(
    x: torch.Tensor,
    layout: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    out_features: int,
) -> torch.Tensor:
    """x [M, K] float32 or bf16 (contiguous, M >= 1) @ W^T (+ bias float32 [N]) -> [M, N] in x's dtype."""
    ext = ops.kernel("quantized_linear", "woq_avx2")
    if ext is None:
        raise RuntimeError("avx2.matmul: the op table has no AVX2 kernel here (or it is forced to torch)")
    codes, s, m = layout
    k = codes.shape[1] * BLOCK
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"avx2.matmul: x must be float32 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"avx2.matmul: x must be [M, K] with M >= 1, got {tuple(x.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"avx2.matmul: x has K = {x.shape[1]}, the layer takes {k}")
    if not x.is_contiguous():
        raise ValueError("avx2.matmul: x must be contiguous")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"avx2.matmul: bias must be [{out_features}], got {tuple(bias.shape)}")
    bits = layout_bits(layout)  # 6 where pack kept Q6_K's codes in 6 bits
    return ext.matmul(x, codes, s, m, bias, bits, k if group_size is None else group_size, out_features)
