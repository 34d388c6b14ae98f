"""QuantLinear: packed CPU kernels vs dequantize-then-matmul, the dequantize path, GGUF blocks, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from quant_helpers import rounded_x

from pagedllm import ops
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.gguf_layout import unpermute_qk
from pagedllm.quantization import amx, woq_kernels
from pagedllm.quantization.gguf_native import decode_blocks, gguf_quant_linear
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.model import quantize_model
from pagedllm.quantization.rtn import rtn_quantize_weight
from pagedllm.quantization.uniform import dequantize

KERNEL_MAX_ROWS = woq_kernels.KERNEL_MAX_ROWS
GEMV_MAX_ROWS = woq_kernels.GEMV_MAX_ROWS


def kernel_name(layer: QuantLinear) -> str | None:
    """The kernel the layer holds (packed for the dtype of its last call), None for the torch reference."""
    return None if layer.kernel is None else layer.kernel.name


def amx_ext():
    """The AMX kernels' C++ module (gemv, gemm), from the op table: None below the amx tier."""
    return ops.kernel("quantized_linear", "woq_amx")


def weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a per-row offset, so zero points sit away from the middle code (the kernels' zero terms matter)
    return torch.randn(out_f, in_f, generator=g) / in_f**0.5 + 0.02 * torch.randn(out_f, 1, generator=g)


def activations(rows: int, in_f: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=g).to(torch.bfloat16)


def assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y should be x @ w^T (w float32) as well as bf16 allows: measured against what a plain bf16 layer
    (the weight rounded to bf16) gets wrong on the same input, its error may be at most about twice that."""
    ref = x.float() @ w.T
    plain = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
    err, err_plain = (y.float() - ref).abs(), (plain - ref).abs()
    assert err.mean() <= 2 * err_plain.mean() + 1e-6, (err.mean(), err_plain.mean())
    assert err.max() <= 4 * err_plain.max() + 1e-6, (err.max(), err_plain.max())


def rounds_x_to_int8(layer: QuantLinear, rows: int) -> bool:
    """Whether the layer's kernel at this many rows takes x rounded to int8 per 32 inputs: the AVX2 kernel at
    every row count, the AMX layout's gemv at 1-GEMV_MAX_ROWS rows (its tiles above take bf16 x)."""
    name = kernel_name(layer)
    return name == "avx2" or (name == "amx" and rows <= GEMV_MAX_ROWS)


def assert_close_for_path(layer: QuantLinear, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = layer(x) against x @ w^T (w float32) within the bound of the kernel that ran (the layer's, packed
    by that call for x's dtype): the int8 kernels round x to int8 per 32 inputs (their contract,
    tests/test_woq_avx2.py: relative error < 1.5e-2), every other kernel is bf16-close (assert_bf16_close)."""
    if rounds_x_to_int8(layer, x.reshape(-1, x.shape[-1]).shape[0]):
        ref = x.float() @ w.T
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1.5e-2
    else:
        assert_bf16_close(y, x, w)


def no_reference(x):
    raise AssertionError("the reference (dequantize + F.linear) ran instead of the kernel")


class CallSpy:
    """Wraps a C++ module; records the names of the functions called through it."""

    def __init__(self, ext):
        self.ext, self.calls = ext, []

    def __getattr__(self, name):
        fn = getattr(self.ext, name)

        def called(*args):
            self.calls.append(name)
            return fn(*args)

        return called


@pytest.fixture
def torch_packed():
    """torch's packed INT4 / INT8 kernels (bf16, up to KERNEL_MAX_ROWS rows; the reference's dequantize
    path above, and for other dtypes and shapes), on any CPU: they use no C++ of ours."""
    with ops.forced(quantized_linear="torch-packed"):
        yield


SCHEMES = [(4, 32), (4, 64), (4, 128), (8, None)]


@pytest.mark.parametrize("bits,group_size", SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_packed_kernel_equals_dequantize_reference(bits, group_size, rows, torch_packed, monkeypatch):
    w = weight(192, 512)
    layer = QuantLinear.from_quantized(rtn_quantize_weight(w, bits, group_size))
    layer.pack()  # torch's kernel, also where AMX or AVX2 would take the layer
    assert kernel_name(layer) == "torch-packed" and layer.layout
    assert woq_kernels.TorchPackedKernel.kind(layer) == ("int4" if bits == 4 else "int8")
    x = activations(rows, 512)
    w_hat = layer.dequantize_weight(torch.float32)  # s*q + m exactly
    with monkeypatch.context() as m:  # the kernel itself at every row count (INT8 leaves it above 48 rows)
        m.setitem(KERNEL_MAX_ROWS, woq_kernels.TorchPackedKernel.kind(layer), rows)
        m.setattr(layer, "forward_native", no_reference)
        assert not layer.kernel.dequantizes_at(layer, rows)
        assert_bf16_close(layer.kernel.matmul(layer, x), x, w_hat)
    assert_bf16_close(layer(x), x, w_hat)
    assert kernel_name(layer) == "torch-packed"


@pytest.mark.parametrize("bits,group_size", SCHEMES)
def test_rows_above_threshold_leave_torchs_kernels(bits, group_size, monkeypatch):
    """The table's kernel (AMX: the gemv kernel for a few rows, its tiles above; AVX2: one kernel for every
    row count, fp32 and bf16); and torch's packed kernels, forced here on any CPU, hand calls above
    KERNEL_MAX_ROWS rows to the dequantize path."""
    layer = QuantLinear.from_quantized(rtn_quantize_weight(weight(64, 256), bits, group_size))
    kind = "int4" if bits == 4 else "int8"
    backend = ops.backend("quantized_linear")
    if backend == "avx2":  # one kernel for every row count, fp32 and bf16
        for dtype in (torch.bfloat16, torch.float32):
            assert woq_kernels.choose(layer, dtype).name == "avx2"
        layer.pack()
        assert kernel_name(layer) == "avx2" and layer.layout and layer.qweight is None
        assert not any(layer.kernel.dequantizes_at(layer, r) for r in (1, 64, 1000))
        x = activations(KERNEL_MAX_ROWS[kind] + 1, 256)
        assert_close_for_path(layer, layer(x), x, layer.dequantize_weight())
        assert kernel_name(layer) == "avx2"
    elif backend == "amx":  # the AMX layout's gemv kernel for a few rows, its tiles above; no torch kernel
        assert woq_kernels.choose(layer, torch.float32).name == "avx2"  # fp32 activations: the AVX2 kernel
        layer.pack()
        assert kernel_name(layer) == "amx" and layer.layout and layer.qweight is None
        spy = CallSpy(layer.kernel.ext)
        monkeypatch.setattr(layer.kernel, "ext", spy)
        for rows, fn in ((1, "gemv"), (GEMV_MAX_ROWS, "gemv"), (GEMV_MAX_ROWS + 1, "gemm"), (1000, "gemm")):
            spy.calls.clear()
            layer(activations(rows, 256))
            assert spy.calls == [fn], (rows, spy.calls)
    with ops.forced(quantized_linear="torch-packed"):
        rows = KERNEL_MAX_ROWS[kind] + 1
        layer.pack()
        assert kernel_name(layer) == "torch-packed" and layer.qweight is not None
        assert layer.kernel.dequantizes_at(layer, rows)
        assert not layer.kernel.dequantizes_at(layer, rows - 1)
        x = activations(rows, 256)
        expected = F.linear(x, layer.dequantize_weight(torch.bfloat16))
        assert torch.equal(layer(x), expected)


needs_amx = pytest.mark.skipif(amx_ext() is None, reason="no AMX on this CPU (or no compiler)")


@needs_amx
@pytest.mark.parametrize("bits,group_size", [*SCHEMES, (8, 32), (8, 64)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 100])
def test_amx_kernel_equals_dequantize_reference(bits, group_size, rows):
    w, b = weight(208, 256), torch.randn(208)  # 13 column tiles of 16: an odd last block of 32
    layer = QuantLinear.from_quantized(rtn_quantize_weight(w, bits, group_size), bias=b)
    layer.pack()
    assert kernel_name(layer) == "amx"
    x = activations(rows, 256)
    codes, scales, mins = layer.layout
    y = amx_ext().gemm(x, codes, scales, mins, layer.bias.to(torch.bfloat16), bits, group_size or 256, 208)
    # the same products as a bf16 GEMM over the dequantized weight (rounded to bf16 once), summed in
    # float32 in another order: equal to that GEMM's float32 result rounded once, but for rare last bits
    w_bf16 = layer.dequantize_weight(torch.bfloat16).float()
    exact = (x.float() @ w_bf16.T + layer.bias.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert (y == exact).float().mean() > 0.99
    torch.testing.assert_close(y.float(), exact.float(), rtol=2**-7, atol=1e-3)
    assert_bf16_close(y - layer.bias.to(torch.bfloat16), x, layer.dequantize_weight())


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [150, 900])
def test_amx_kernel_prefill_strips_equal_row_chunks(bits, rows):
    """Above 64 rows the kernel dequantizes several column blocks at a time (256 KB: 2 blocks at K = 2048,
    so 7 blocks make strips of 2, 2, ... and a last one of 1; from 896 rows 512 KB, strips of 4 and 3) and
    passes x over them; each output is the same sum as when 32 rows at a time meet one block at a time."""
    k = 2048
    layer = QuantLinear.from_quantized(rtn_quantize_weight(weight(208, k), bits, 64), bias=torch.randn(208))
    layer.pack()
    assert kernel_name(layer) == "amx"
    args = (*layer.layout, layer.bias.to(torch.bfloat16), bits, 64, 208)
    x = activations(rows, k)
    whole = amx_ext().gemm(x, *args)
    chunks = torch.cat([amx_ext().gemm(x[i : i + 32], *args) for i in range(0, rows, 32)])
    assert torch.equal(whole, chunks)
    assert torch.equal(layer(x), whole)  # the layer runs the tiles at this many rows


@needs_amx
@pytest.mark.parametrize("bits,group_size", [*SCHEMES, (8, 32), (4, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])  # above 4, a second pass over the codes
def test_gemv_kernel_is_the_product_on_x_rounded_to_int8(bits, group_size, rows):
    w, b = weight(208, 512), torch.randn(208)  # 13 column tiles of 16
    layer = QuantLinear.from_quantized(rtn_quantize_weight(w, bits, group_size), bias=b)
    layer.pack()
    assert kernel_name(layer) == "amx" and rows <= GEMV_MAX_ROWS  # the layer runs gemv at this many rows
    x = activations(rows, 512)
    bias = layer.bias.to(torch.bfloat16)
    y = amx_ext().gemv(x, *layer.layout, bias, bits, group_size or 512, 208)
    assert torch.equal(layer(x), y)
    # woq_avx2.h's contract: the float32 product on x rounded to int8 per 32 inputs, exact in int32 and then
    # float32 up to summation order (so within the bf16 output's rounding), and that rounding's error alone
    # against the float32 product on x itself
    w_deq = layer.dequantize_weight().double()
    emulated = rounded_x(x).double() @ w_deq.T + bias.double()
    ref = x.double() @ w_deq.T + bias.double()
    err = (y.double() - emulated).abs()
    assert (err <= emulated.abs() * 2**-8 + 1e-6).all(), err.max()  # bf16 output: half a unit, and a hair
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1.5e-2


@needs_amx
def test_gemv_kernel_rejects_more_rows_than_it_takes():
    layer = QuantLinear.from_quantized(rtn_quantize_weight(weight(64, 256), 4, 32))
    layer.pack()
    assert kernel_name(layer) == "amx" and GEMV_MAX_ROWS == 8
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        amx_ext().gemv(activations(9, 256), *layer.layout, None, 4, 32, 64)


@needs_amx
def test_amx_kernel_rejects_shapes_it_cannot_tile():
    assert not amx.supports(4, 256, 200, 32)  # out not a multiple of 16
    assert not amx.supports(4, 48, 64, None)  # in not a multiple of 32
    assert not amx.supports(4, 256, 64, 16)  # group of 16
    assert not amx.supports(3, 256, 64, 32)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        amx_ext().gemm(
            activations(2, 48),
            *amx.pack_codes(torch.zeros(64, 48, dtype=torch.uint8), torch.ones(64, 3), torch.zeros(64, 3), 4),
            None,
            4,
            16,
            64,
        )


def test_dequantize_weight_is_the_quantizers_dequantize():
    w = weight(48, 96)
    for bits, g in [(2, 32), (3, 32), (4, 32), (5, None), (7, 48), (8, None), (8, 32)]:
        qt = rtn_quantize_weight(w, bits, g)
        layer = QuantLinear.from_quantized(qt)
        assert torch.equal(layer.codes(), qt.codes)
        torch.testing.assert_close(layer.dequantize_weight(), dequantize(qt), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits,group_size", [(3, 32), (8, 32), (6, None)])
def test_other_widths_run_the_dequantize_path(bits, group_size):
    layer = QuantLinear.from_quantized(rtn_quantize_weight(weight(64, 128), bits, group_size))
    assert woq_kernels.TorchPackedKernel.kind(layer) is None  # no torch kernel: INT4 groups, INT8 per channel
    x = activations(4, 128)
    assert_close_for_path(layer, layer(x), x, layer.dequantize_weight())
    # 8-bit group-wise codes (GGUF Q8_0) are the AMX and AVX2 kernels' too; other widths only the reference's
    ours = {"amx": "amx", "avx2": "avx2"}.get(ops.backend("quantized_linear"))
    assert kernel_name(layer) == (ours if bits == 8 else None)


def test_fp32_activations_are_exact_and_bias_is_added(torch_packed):
    w, b = weight(32, 64), torch.randn(32)
    layer = QuantLinear.from_quantized(rtn_quantize_weight(w, 4, 32), bias=b)
    x = torch.randn(5, 2, 64)
    ref = F.linear(x, layer.dequantize_weight(), b)
    torch.testing.assert_close(layer(x), ref, rtol=1e-6, atol=1e-6)
    assert kernel_name(layer) is None  # torch's kernels take bf16 only: fp32 runs the reference
    xb = x.to(torch.bfloat16)
    assert_bf16_close(layer(xb).reshape(10, 32) - b, xb.reshape(10, 64), layer.dequantize_weight())
    assert kernel_name(layer) == "torch-packed"  # the INT4 kernel, its bias added


@pytest.mark.parametrize("backend", ["table", "torch-packed", "torch"])
def test_weight_bytes(backend):
    """The table's kernel (amx, avx2 or torch-packed), torch's packed kernels (forced, on any CPU) and the
    reference: resident bytes are the stored form plus the kernel's layout, less what it releases."""
    w = weight(128, 256)
    if backend == "table":
        backend = ops.backend("quantized_linear")
    with ops.forced(quantized_linear=backend):
        int8 = QuantLinear.from_quantized(rtn_quantize_weight(w, 8, None))
        int8.pack()
        int4 = QuantLinear.from_quantized(rtn_quantize_weight(w, 4, 32))
        stored = 128 * 128 + 2 * 128 * 8 * 4
        assert int4.weight_bytes() == stored
        int4.pack()
        expected = None if backend == "torch" else backend  # both shapes are every kernel's
        assert kernel_name(int8) == kernel_name(int4) == expected
        if backend in ("amx", "avx2"):
            # the kernel's layout instead of the stored form: the same bytes in another order (codes + fp32
            # scales / mins; 8 columns a panel for AVX2, 16 for AMX: 128 needs no padding)
            assert int8.qweight is None and int8.weight_bytes() == 128 * 256 + 128 * (4 + 4)
            assert int4.qweight is None and int4.weight_bytes() == stored
        elif backend == "torch-packed":
            # int8 codes once (the kernel reads them in place) + fp32 scale/min + bf16 unit scales + fp32
            # correction; int4: + the INT4 kernel's own nibble layout and bf16 (scale, zero) pairs
            assert int8.qweight is not None and int4.qweight is not None
            assert int8.weight_bytes() == 128 * 256 + 128 * (4 + 4 + 2 + 4)
            assert int4.weight_bytes() == stored + 128 * 128 + 8 * 128 * 2 * 2
        else:  # the reference keeps the stored form only
            assert int8.layout == int4.layout == ()
            assert int8.weight_bytes() == 128 * 256 + 128 * (4 + 4)
            assert int4.weight_bytes() == stored


def test_bad_bits_and_group_size_raise_input_error():
    with pytest.raises(InputError, match="bits"):
        QuantLinear(64, 64, bits=9, group_size=None)
    with pytest.raises(InputError, match=r"mlp\.down_proj.*group_size 100.*in_features 576"):
        QuantLinear(576, 64, bits=4, group_size=100, name="model.layers.0.mlp.down_proj")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    with pytest.raises(InputError, match=r"^layer 1: group_size 64 does not divide in_features 32"):
        quantize_model(model, bits=4, group_size=64)
    assert all(isinstance(m, torch.nn.Linear) for m in model)  # checked before anything was replaced


# ---- GGUF blocks ---------------------------------------------------------------------------------------
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_blocks(type_name: str, rows: int = 64, cols: int = 128):
    w = weight(rows, cols, seed=3).numpy()
    w[0, :32] = 0.25  # a constant block (Q4_1: d = 0)
    qtype = GGMLQuantizationType[type_name]
    raw = gguf_quantize(w, qtype)
    return raw, gguf_dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_dequantize_bit_exactly(type_name):
    raw, ref = gguf_blocks(type_name)
    codes, scales, mins, bits = decode_blocks(type_name, raw, ref.shape)
    layer = QuantLinear.from_codes(codes, scales, mins, bits, 32)
    assert torch.equal(layer.dequantize_weight(torch.float32), torch.from_numpy(ref))


@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 8, 100])
@pytest.mark.parametrize("backend", ["table", "torch-packed"])
def test_gguf_layer_output_equals_dequantized_layer(type_name, rows, backend):
    """On the table's kernel, and on torch's (forced: they run on any CPU)."""
    if backend == "table":
        backend = ops.backend("quantized_linear")
    raw, ref = gguf_blocks(type_name)
    codes, scales, mins, bits = decode_blocks(type_name, raw, ref.shape)
    with ops.forced(quantized_linear=backend):
        layer = QuantLinear.from_codes(codes, scales, mins, bits, 32)
        layer.pack()
        if backend in ("amx", "avx2"):  # the layout holds the blocks: the stored form is released
            assert kernel_name(layer) == backend and layer.layout and layer.qweight is None
        else:  # Q8_0: per-block scales, no INT8 kernel (the reference runs)
            assert kernel_name(layer) == ("torch-packed" if bits == 4 else None)
        x = activations(rows, 128)
        assert_close_for_path(layer, layer(x), x, torch.from_numpy(ref))


def assert_same_products(layer: QuantLinear, wide: tuple[torch.Tensor, ...]) -> None:
    """The AMX kernels (gemv at 1 and 3 rows, gemm at 20) give the same output bit for bit on the layer's layout
    and on `wide`: its codes with the scales and mins as float32 [N/16, groups, 16]."""
    for rows in (1, 3, 20):
        x = activations(rows, layer.in_features)
        kernel = amx_ext().gemv if rows <= GEMV_MAX_ROWS else amx_ext().gemm
        args = (layer.bits, 32, layer.out_features)
        assert torch.equal(kernel(x, *layer.layout, None, *args), kernel(x, *wide, None, *args))
        assert torch.equal(layer(x), kernel(x, *wide, None, *args))


@needs_amx
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_scales_and_mins_are_held_in_float16_or_derived_with_the_same_results(type_name):
    raw, ref = gguf_blocks(type_name)
    layer = QuantLinear.from_codes(*decode_blocks(type_name, raw, ref.shape), 32)
    layer.pack()
    assert kernel_name(layer) == "amx"
    codes, scales, mins = layer.layout
    assert scales.dtype == torch.float16  # GGUF's block scales are float16 values
    derived = type_name in ("Q4_0", "Q8_0")  # symmetric: m = -8 s, -128 s; the layout keeps only the factor
    assert (mins.dtype, mins.numel()) == (torch.float32, 1) if derived else mins.dtype == torch.float16
    assert torch.equal(layer.dequantize_weight(torch.float32), torch.from_numpy(ref))
    wide = (codes, scales.float(), scales.float() * mins if derived else mins.float())  # the same, float32
    assert_same_products(layer, wide)
    rtn = QuantLinear.from_quantized(rtn_quantize_weight(weight(64, 128), 4, 32))
    rtn.pack()
    assert kernel_name(rtn) == "amx"
    assert rtn.layout[1].dtype == torch.float32  # computed scales: float16 would round them


def test_gguf_q_k_rows_are_unpermuted():
    cfg = ModelConfig(
        vocab_size=10, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=32, architecture="llama",
    )  # fmt: skip
    for name, rows, heads in [
        ("model.layers.0.self_attn.q_proj", 128, 4),
        ("model.layers.0.self_attn.k_proj", 64, 2),
    ]:
        raw, ref = gguf_blocks("Q4_1", rows=rows)
        layer = gguf_quant_linear(name, "Q4_1", raw, ref.shape, cfg)
        assert torch.equal(layer.dequantize_weight(), torch.from_numpy(unpermute_qk(ref, heads).copy()))
    raw, ref = gguf_blocks("Q4_1")
    v = gguf_quant_linear("model.layers.0.self_attn.v_proj", "Q4_1", raw, ref.shape, cfg)
    assert torch.equal(v.dequantize_weight(), torch.from_numpy(ref))
    assert not np.array_equal(unpermute_qk(ref, 2), ref)  # the permutation is not the identity


@pytest.mark.parametrize("kernel", ["amx", "avx2"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, None), (8, 32)])
def test_released_layer_rebuilds_its_stored_form_from_the_kernels_layout(bits, group_size, kernel):
    if ops.kernel("quantized_linear", f"woq_{kernel}") is None:
        pytest.skip(f"no {kernel} kernel on this CPU (or no compiler)")
    w, b = weight(96, 128), torch.randn(96)
    layer = QuantLinear.from_quantized(rtn_quantize_weight(w, bits, group_size), bias=b)
    codes, (scales, mins) = layer.codes(), layer.scales_and_mins()
    dequantized = layer.dequantize_weight()
    x = activations(GEMV_MAX_ROWS + 1, 128)  # the AMX tiles at the amx tier
    before = layer.weight_bytes()
    with ops.forced(quantized_linear=kernel):  # the AVX2 kernel takes bf16 too (forced at the amx tier)
        layer.pack()  # builds the kernel's layout, then releases the stored form it repeats
        assert kernel_name(layer) == kernel and layer.kernel.holds_weight
        assert layer.qweight is None and layer.scales is None and layer.mins is None
        assert torch.equal(layer.codes(), codes)
        assert all(map(torch.equal, layer.scales_and_mins(), (scales, mins)))
        assert torch.equal(layer.dequantize_weight(), dequantized)
        y = layer(x)
        assert kernel_name(layer) == kernel
        if kernel == "amx":
            expected = F.linear(x, dequantized.to(torch.bfloat16), b.to(torch.bfloat16))
            torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-3)
        else:  # x rounded to int8 per 32 inputs (tests/test_woq_avx2.py)
            ref = x.float() @ dequantized.T + b
            assert ((y.float() - ref).norm() / ref.norm()).item() < 1.5e-2
        packed = sum(t.numel() * t.element_size() for t in layer.layout)
        assert layer.weight_bytes() == before + packed - (codes.numel() * bits // 8 + 2 * scales.numel() * 4)
    with ops.forced(quantized_linear="torch"):  # another backend: the stored form comes back from the layout
        assert torch.equal(layer(x), F.linear(x, dequantized.to(torch.bfloat16), b.to(torch.bfloat16)))
        assert kernel_name(layer) is None and layer.layout == () and layer.weight_bytes() == before
        assert torch.equal(layer.codes(), codes)
        assert all(map(torch.equal, layer.scales_and_mins(), (scales, mins)))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, None)])
def test_without_our_kernels_torchs_kernels_and_the_dequantize_path_serve(monkeypatch, bits, group_size):
    """CPUs where no C++ kernel of ours loads (backend "torch-packed", forced here: neither the AMX nor the
    AVX2 kernel): torch's kernels up to KERNEL_MAX_ROWS, then dequantize."""
    with ops.forced(quantized_linear="torch-packed"):
        assert ops.kernel("quantized_linear", "woq_amx") is None
        assert ops.kernel("quantized_linear", "woq_avx2") is None
        layer = QuantLinear.from_quantized(rtn_quantize_weight(weight(64, 256), bits, group_size))
        kind = "int4" if bits == 4 else "int8"
        layer.pack()
        assert kernel_name(layer) == "torch-packed" and woq_kernels.TorchPackedKernel.kind(layer) == kind
        assert layer.layout and layer.qweight is not None  # nothing released
        top = KERNEL_MAX_ROWS[kind]
        for rows, dequantizes in ((1, False), (top, False), (top + 1, True)):
            assert layer.kernel.dequantizes_at(layer, rows) == dequantizes
            x = activations(rows, 256)
            with monkeypatch.context() as m:
                if not dequantizes:  # the kernel itself, not the reference
                    m.setattr(layer, "forward_native", no_reference)
                assert_bf16_close(layer(x), x, layer.dequantize_weight())
            assert kernel_name(layer) == "torch-packed"
        layer(torch.randn(1, 256))
        assert kernel_name(layer) is None  # fp32 activations: the reference


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_layout_gives_rows_without_unpacking_the_table(bits):
    """amx.rows reads only the asked rows' subtiles (a tied lm_head's embedding lookup at the amx tier: the
    whole-table unpack cost ~200 ms a decode step on a 1B model's 49152-row table); pure torch, so tested on
    every CPU."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 2**bits, (80, 96), dtype=torch.uint8, generator=gen)
    scales, mins = torch.rand(80, 3, generator=gen), torch.rand(80, 3, generator=gen)
    layout = amx.pack_codes(codes, scales, mins, bits)
    ids = torch.tensor([0, 79, 7, 8, 15, 16, 31, 7, 40])
    got_codes, got_scales, got_mins = amx.rows(layout, ids, bits)
    assert torch.equal(got_codes, codes[ids])
    assert torch.equal(got_scales, amx.unpack_scales_mins(layout[1], layout[2])[0][ids])
    assert torch.equal(got_mins, amx.unpack_scales_mins(layout[1], layout[2])[1][ids])


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quants_keep_two_level_scales_in_the_amx_layout_with_the_same_results(type_name):
    """GGUF's K-quant scales and mins as the file factors them (float16 d x int8 codes a super-block): 0.625
    bits a weight to stream where float32 took 2, the same values, so the same products bit for bit."""
    from test_gguf_blocks import random_blocks

    raw = random_blocks(type_name, 64, 512, seed=4)
    cfg = ModelConfig(
        vocab_size=64, hidden_size=512, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
        head_dim=128, architecture="llama",
    )  # fmt: skip
    layer = gguf_quant_linear("model.layers.0.mlp.up_proj", type_name, raw, (64, 512), cfg)
    with ops.forced(quantized_linear="torch"):
        want = layer.dequantize_weight(torch.float32)
    sb = layer.superblocks
    layer.pack()
    assert kernel_name(layer) == "amx"
    codes, scales, mins = layer.layout
    assert scales.dtype == mins.dtype == torch.uint8 and scales.shape == (4, 2, 32 + 16 * 8)
    assert torch.equal(layer.dequantize_weight(torch.float32), want)
    again = layer.superblocks_now()  # what a merge (QuantLinear.concat) packs again
    assert all(torch.equal(getattr(again, f), getattr(sb, f)) for f in ("d", "scale_codes", "dmin", "min_codes"))
    ids = torch.tensor([0, 63, 17, 8])
    assert torch.equal(layer.rows(ids), want[ids])
    s, m = amx.unpack_scales_mins(scales, mins)
    wide = (codes, *(t.view(4, 16, -1).transpose(1, 2).contiguous() for t in (s, m)))  # float32 [N/16, G, 16]
    assert_same_products(layer, wide)
