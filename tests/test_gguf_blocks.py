"""GGUF block decoding (quantization/gguf_blocks.py): codes, scales and mins that give back exactly what
gguf.quants.dequantize gives, for every type served from its blocks, and the kernels on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagedllm import ops
from pagedllm.quantization import gguf_blocks
from pagedllm.quantization.linear import QuantLinear


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes are valid blocks once the fp16 scales are finite, normal values: every code, sub-block
    scale and min and every 5th bit pattern occurs."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1  # d (and m / dmin) lead the block
    scale = rng.uniform(1e-4, 2e-2, size=(rows, cols // block, halves)).astype(np.float16)
    if type_name in ("Q4_1", "Q5_1"):
        scale[..., 1] = -scale[..., 1] * 8  # a min of the sign real files have
    raw[..., : 2 * halves] = scale.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", gguf_blocks.NATIVE_TYPES)
@pytest.mark.parametrize("shape", [(16, 256), (40, 512)])
def test_decoded_blocks_dequantize_exactly_as_gguf(type_name, shape):
    raw = random_blocks(type_name, *shape)
    codes, scales, mins, bits = gguf_blocks.decode(type_name, raw, shape)
    assert codes.shape == shape and scales.shape == mins.shape == (shape[0], shape[1] // 32)
    assert codes.max() < 2 ** (5 if type_name.startswith("Q5") else bits)
    layer = QuantLinear.from_codes(
        torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), bits, 32
    )
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape)
    with ops.forced(quantized_linear="torch"):
        got = layer.dequantize_weight(torch.float32).numpy()
    assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_quantized_by_gguf_round_trips(type_name):
    """Blocks the gguf package itself writes (not random bytes) decode to its own dequantization."""
    from gguf.quants import quantize

    w = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    codes, scales, mins, bits = gguf_blocks.decode(type_name, raw, w.shape)
    got = torch.from_numpy(codes).float().view(8, 8, 32) * torch.from_numpy(scales)[..., None]
    got = (got + torch.from_numpy(mins)[..., None]).reshape(8, 256).numpy()
    assert np.array_equal(got, gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(8, 256))


@pytest.mark.parametrize("type_name", gguf_blocks.NATIVE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_decoded_blocks_matches_the_dequantized_matmul(type_name, dtype):
    """The kernel the table picks for these layers, against gguf's dequantized weight and a float matmul:
    within the AVX2 kernel's contract (int8 activations, relative error < 1.5e-2) or bf16's."""
    shape = (48, 512)
    raw = random_blocks(type_name, *shape, seed=7)
    codes, scales, mins, bits = gguf_blocks.decode(type_name, raw, shape)
    layer = QuantLinear.from_codes(
        torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), bits, 32
    )
    layer.pack(dtype)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(shape))
    for rows in (1, 5, 33):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        ref = x.float() @ w.T
        err = ((layer(x).float() - ref).norm() / ref.norm()).item()
        assert err < 1.5e-2, (type_name, rows, layer.kernel.name if layer.kernel else None, err)
