"""GGUF block decoding (quantization/gguf_blocks.py): codes, scales and mins that give back exactly what
gguf.quants.dequantize gives, for every type served from its blocks, and the kernels on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from quant_helpers import rounded_x

from pagedllm import ops
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.quantization import gguf_blocks
from pagedllm.quantization.gguf_native import gguf_quant_linear
from pagedllm.quantization.linear import QuantLinear

CODE_BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}  # codes held in 8 bits that use fewer


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes are valid blocks once the fp16 scales are finite, normal values: every code, sub-block
    scale and min and every 5th (6th) bit pattern occurs. d (and m / dmin) lead the block, except Q6_K's
    d: its last 2 bytes (its int8 sub-block scales stay random, of either sign)."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1
    scale = rng.uniform(1e-4, 2e-2, size=(rows, cols // block, halves)).astype(np.float16)
    if type_name in ("Q4_1", "Q5_1"):
        scale[..., 1] = -scale[..., 1] * 8  # a min of the sign real files have
    at = slice(size - 2, size) if type_name == "Q6_K" else slice(0, 2 * halves)
    raw[..., at] = scale.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", gguf_blocks.NATIVE_TYPES)
@pytest.mark.parametrize("shape", [(16, 256), (40, 512)])
def test_decoded_blocks_dequantize_exactly_as_gguf(type_name, shape):
    raw = random_blocks(type_name, *shape)
    codes, scales, mins, bits, group = gguf_blocks.decode(type_name, raw, shape)
    assert group == (16 if type_name == "Q6_K" else 32)
    assert codes.shape == shape and scales.shape == mins.shape == (shape[0], shape[1] // group)
    assert codes.max() < 2 ** CODE_BITS.get(type_name, bits)
    layer = QuantLinear.from_codes(
        torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), bits, group
    )
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
    with ops.forced(quantized_linear="torch"):
        got = layer.dequantize_weight(torch.float32).numpy()
    assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])  # gguf.quants writes no Q6_K (nor K-quant)
def test_quantized_by_gguf_round_trips(type_name):
    """Blocks the gguf package itself writes (not random bytes) decode to its own dequantization."""
    from gguf.quants import quantize

    w = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    codes, scales, mins, bits, group = gguf_blocks.decode(type_name, raw, w.shape)
    got = torch.from_numpy(codes).float().view(8, -1, group) * torch.from_numpy(scales)[..., None]
    got = (got + torch.from_numpy(mins)[..., None]).reshape(8, 256).numpy()
    assert np.array_equal(got, gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(8, 256))


@pytest.mark.parametrize("type_name", gguf_blocks.NATIVE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_decoded_blocks_matches_the_dequantized_matmul(type_name, dtype):
    """The kernel the table picks for these layers, against gguf's dequantized weight and a float matmul:
    within the AVX2 kernel's contract (int8 activations, relative error < 1.5e-2) or bf16's."""
    shape = (48, 512)
    raw = random_blocks(type_name, *shape, seed=7)
    codes, scales, mins, bits, group = gguf_blocks.decode(type_name, raw, shape)
    layer = QuantLinear.from_codes(
        torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), bits, group
    )
    layer.pack(dtype)
    if ops.kernel("quantized_linear", "woq_avx2") is not None and ops.backend("quantized_linear") != "torch":
        assert layer.kernel is not None  # served from the blocks (Q6_K: the AVX2 kernel's group 16)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape))
    for rows in (1, 5, 33):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        ref = x.float() @ w.T
        err = ((layer(x).float() - ref).norm() / ref.norm()).item()
        assert err < 1.5e-2, (type_name, rows, layer.kernel.name if layer.kernel else None, err)


def test_q6_k_scales_are_exact_products():
    """Q6_K's s = d * sc and m = -32 s in float32 are the exact products (d fp16: 11 bits, sc int8: 7 bits),
    so s * q + m is d * sc * (q - 32) exactly, for the extreme sub-block scales -128 and 127 as well."""
    raw = random_blocks("Q6_K", 4, 512, seed=5).reshape(4, 2, 210)
    raw[0, 0, 192:208] = np.array([-128, 127, -1, 1] * 4, dtype=np.int8).view(np.uint8)
    raw[0, 0, 208:210] = np.array([np.float16(65504.0) / 128], dtype=np.float16).view(np.uint8)  # a big d
    raw = raw.reshape(4, -1)
    codes, scales, mins, bits, group = gguf_blocks.decode("Q6_K", raw, (4, 512))
    d = raw.reshape(4, 2, 210)[..., 208:210].copy().view(np.float16).astype(np.float64)  # [4, 2, 1]
    sc = raw.reshape(4, 2, 210)[..., 192:208].view(np.int8).astype(np.float64)  # [4, 2, 16]
    assert np.array_equal(scales.astype(np.float64), (d * sc).reshape(4, 32))
    assert np.array_equal(mins.astype(np.float64), (-32 * d * sc).reshape(4, 32))
    want = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(4, 512)
    got = codes.astype(np.float32).reshape(4, 32, 16) * scales[..., None] + mins[..., None]
    assert np.array_equal(got.reshape(4, 512), want)


def test_gguf_quant_linear_takes_the_group_of_the_type():
    cfg = ModelConfig(
        vocab_size=10, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=64, architecture="llama",
    )  # fmt: skip
    for type_name, group in (("Q6_K", 16), ("Q4_K", 32), ("Q8_0", 32)):
        raw = random_blocks(type_name, 64, 256, seed=11)
        layer = gguf_quant_linear("model.layers.0.mlp.down_proj", type_name, raw, (64, 256), cfg)
        assert layer.group_size == group and layer.scales.shape == (64, 256 // group)
        want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(64, 256)
        with ops.forced(quantized_linear="torch"):
            assert np.array_equal(layer.dequantize_weight(torch.float32).numpy(), want)


@pytest.mark.parametrize("type_name", gguf_blocks.K_QUANTS)
def test_super_blocks_give_the_decoded_scales_exactly(type_name):
    """super_blocks' d * codes are decode()'s float32 scales and mins, bit for bit (the products are exact)."""
    raw = random_blocks(type_name, 24, 512, seed=13)
    _, scales, mins, _, group = gguf_blocks.decode(type_name, raw, (24, 512))
    sb = gguf_blocks.super_blocks(type_name, raw, (24, 512))
    assert sb.groups == 256 // group and sb.scale_codes.dtype == sb.min_codes.dtype == torch.int8
    for d, q, want in ((sb.d, sb.scale_codes, scales), (sb.dmin, sb.min_codes, mins)):
        got = d.repeat_interleave(sb.groups, dim=1) * q.float()
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    assert gguf_blocks.super_blocks("Q4_0", random_blocks("Q4_0", 4, 256), (4, 256)) is None


@pytest.mark.skipif(
    ops.kernel("quantized_linear", "woq_avx2") is None, reason="no AVX2 kernel on this machine"
)
@pytest.mark.parametrize("type_name", gguf_blocks.K_QUANTS)
def test_two_level_layout_runs_the_float_layout_bit_for_bit(type_name):
    """The AVX2 layout keeps a K-quant's super-blocks (int8 codes + a float16 super-scale, as the file has
    it; Q6_K no mins at all, they are -32 x its scales): fewer bytes than float32 scales and mins, and the
    same numbers: equal outputs at every row count, and unpack / super-blocks give the weight back exactly;
    merged layers (q, k, v) keep the form."""
    from pagedllm.quantization import avx2

    shape = (40, 512)  # 40 rows: a padded last panel
    raw = random_blocks(type_name, *shape, seed=17)
    codes, scales, mins, bits, group = (torch.from_numpy(t) if isinstance(t, np.ndarray) else t
                                        for t in gguf_blocks.decode(type_name, raw, shape))  # fmt: skip
    sb = gguf_blocks.super_blocks(type_name, raw, shape)
    two = avx2.pack(codes, scales, mins, bits, sb)
    flat = avx2.pack(codes, scales, mins, bits)
    assert two[1].dtype == torch.uint8 and flat[1].dtype == torch.float32
    assert two[1].nbytes + two[2].nbytes < 0.4 * (flat[1].nbytes + flat[2].nbytes)  # 1 + 2/sb B, not 4
    assert (avx2.min_factor(two) == -32) == (type_name == "Q6_K") == (avx2.min_factor(flat) == -32)
    span = avx2.x_span(two)  # Q4_K, Q6_K: 256 where this build rounds x per super-block, else 32
    assert avx2.x_span(flat) == 32 and span in (32, 256) and (span == 32 or type_name in ("Q4_K", "Q6_K"))
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name])).double()
    for rows in (1, 5, 33, 300):  # 300: x is quantized on several threads (matmul_into's parallel_for)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
            got = avx2.matmul(x, two, None, bits, group, shape[0])
            if span == 32:
                assert torch.equal(got, avx2.matmul(x, flat, None, bits, group, shape[0])), (rows, dtype)
            else:  # x rounded per super-block: the float32 product on that x, up to float32 (bf16) rounding
                emulated = rounded_x(x, span).double() @ w.T
                err = ((got.double() - emulated).norm() / emulated.norm()).item()
                assert err < (5e-3 if dtype == torch.bfloat16 else 1e-5), (rows, dtype, err)
    back = avx2.unpack(two, bits, shape[0], shape[1], group)
    for got, want in zip(back, (codes, scales, mins)):
        assert torch.equal(got, want)
    again = avx2.superblocks(two, shape[0])
    assert torch.equal(again.d, sb.d) and torch.equal(again.scale_codes, sb.scale_codes)
    assert torch.equal(again.dmin, sb.dmin) and torch.equal(again.min_codes, sb.min_codes)
    # scales that the super-blocks do not give are refused: the float32 form, never wrong numbers
    wrong = gguf_blocks.SuperBlocks(sb.groups, sb.d * 2, sb.scale_codes, sb.dmin, sb.min_codes)
    assert avx2.pack(codes, scales, mins, bits, wrong)[1].dtype == torch.float32

    cfg = ModelConfig(
        vocab_size=10, hidden_size=512, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=128, architecture="llama",
    )  # fmt: skip
    parts = []
    for name, rows in (("q_proj", 512), ("k_proj", 256), ("v_proj", 256)):  # q and k rows are unpermuted
        part_raw = random_blocks(type_name, rows, 512, seed=rows + len(name))
        parts.append(
            gguf_quant_linear(f"model.layers.0.self_attn.{name}", type_name, part_raw, (rows, 512), cfg)
        )
    merged = QuantLinear.concat(parts)
    merged.pack(torch.bfloat16)
    if merged.kernel is not None and merged.kernel.name in ("avx2", "amx"):
        assert merged.layout[1].dtype == torch.uint8
        # packed parts merge by joining their layouts (nothing unpacked): the same layout
        for part in parts:
            part.pack(torch.bfloat16)
        joined = QuantLinear.concat(parts)
        assert joined.qweight is None and joined.kernel is merged.kernel
        assert all(torch.equal(a, b) for a, b in zip(joined.layout, merged.layout, strict=True))
    x = torch.randn(3, 512).bfloat16()
    with ops.forced(quantized_linear="torch"):
        want = torch.cat([p(x) for p in parts], dim=1)
    assert ((merged(x).float() - want.float()).norm() / want.float().norm()).item() < 1.5e-2


def test_unserved_types_are_named_with_their_float_cost():
    """A file with types no kernel serves (Q3_K, IQ*) says which tensors are dequantized and what they cost."""
    from pagedllm.quantization.gguf_native import unserved, unserved_message

    empty = np.zeros(0, np.uint8)
    tensors = {
        "model.layers.0.mlp.down_proj.weight": ("Q3_K", empty, (64, 256)),
        "model.layers.0.mlp.up_proj.weight": ("IQ2_XS", empty, (128, 256)),
        "model.layers.0.self_attn.q_proj.weight": ("Q4_K", empty, (256, 256)),
        "model.norm.weight": ("F32", empty, (256,)),
    }
    rows = unserved(tensors, torch.bfloat16)
    assert rows == [
        ("model.layers.0.mlp.up_proj.weight", "IQ2_XS", 128 * 256 * 2),
        ("model.layers.0.mlp.down_proj.weight", "Q3_K", 64 * 256 * 2),
    ]
    msg = unserved_message(rows)
    assert "2 tensors of type IQ2_XS, Q3_K" in msg and "0 MiB" in msg and "down_proj" in msg
    assert unserved({k: v for k, v in tensors.items() if v[0] in ("Q4_K", "F32")}, torch.bfloat16) == []


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("backend", ["amx", "avx2", "torch-packed", "torch"])
def test_packed_from_codes_is_from_codes_then_pack(type_name, backend):
    """A GGUF load builds a kernel's layout straight from the decoded codes (QuantLinear.packed_from_codes:
    the stored form never made): the same kernel, the same layout bit for bit, the same outputs as from_codes
    + pack."""
    if backend in ("amx", "avx2") and ops.kernel("quantized_linear", f"woq_{backend}") is None:
        pytest.skip(f"no {backend} kernel on this CPU (or no compiler)")
    shape = (64, 256)
    raw = random_blocks(type_name, *shape, seed=11)
    codes, scales, mins, bits, group = (
        torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        for t in gguf_blocks.decode(type_name, raw, shape)
    )
    superblocks = gguf_blocks.super_blocks(type_name, raw, shape)
    bias = torch.randn(shape[0])
    with ops.forced(quantized_linear=backend):
        want = QuantLinear.from_codes(codes, scales, mins, bits, group, bias)
        want.superblocks = superblocks
        want.pack(torch.bfloat16)
        got = QuantLinear.packed_from_codes(
            codes, scales, mins, bits, group, torch.bfloat16, superblocks, bias
        )
        assert got.kernel is want.kernel and got._packed_for == want._packed_for
        assert len(got.layout) == len(want.layout)
        assert all(torch.equal(a, b) for a, b in zip(got.layout, want.layout, strict=True))
        assert (got.qweight is None) == (want.qweight is None)
        reference = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
        assert np.array_equal(got.dequantize_weight(torch.float32).numpy(), reference)
        x = torch.randn(3, shape[1]).bfloat16()
        assert torch.equal(got(x), want(x))
    with pytest.raises(InputError, match="scales"):
        QuantLinear.packed_from_codes(codes, scales[:, :2], mins, bits, group, torch.bfloat16)
