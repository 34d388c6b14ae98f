"""The spec's quantizer: exact scalar examples (C5-C8, C10), tensor quantizer properties, INT4 packing."""

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pagedllm.errors import InputError
from pagedllm.quantization import dequantize, fake_quantize, pack_int4, quantize, unpack_int4
from pagedllm.quantization.explain import exact_str, explain, grid, scale, to_dict
from pagedllm.quantization.uniform import qparams, round_half_up

F = Fraction

# ---------------------------------------------------------------- exact scalar examples (explain.py)


def test_c5_interior_value():
    e = explain("-0.6", "0.9", 4, "0.35")
    assert e.scale == F("0.1")
    assert e.zero_point == 6
    assert e.code_unclipped == 10 and e.code == 10 and not e.clipped
    assert e.reconstructed == F("0.4")
    assert e.error == F("0.05") == e.scale / 2 == e.error_bound


def test_c5_needs_exact_arithmetic():
    # In doubles 0.35 / 0.1 is 3.4999999999999996 and would round to 3: the calculator must not.
    assert 0.35 / 0.1 < 3.5
    assert explain(-0.6, 0.9, 4, 0.35).code == 10  # floats are read as the decimals they print as


def test_c6_boundary_and_clip():
    top = explain("-0.6", "0.9", 4, "0.9")
    assert (top.code_unclipped, top.code, top.reconstructed, top.error) == (15, 15, F("0.9"), 0)
    beyond = explain("-0.6", "0.9", 4, "1.4")
    assert beyond.code_unclipped == 20
    assert beyond.code == 15 and beyond.clipped
    assert beyond.reconstructed == F("0.9")
    assert beyond.error == F("0.5")
    below = explain("-0.6", "0.9", 4, "-2")
    assert below.code_unclipped == -14 and below.code == 0 and below.reconstructed == F("-0.6")


def test_c7_constant_range_exact():
    e = explain("0.3", "0.3", 4, "0.3")
    assert e.reconstructed == F("0.3") and e.error == 0
    assert explain("-0.7", "-0.7", 4, "-0.7").reconstructed == F("-0.7")
    assert explain("0", "0", 4, "0").reconstructed == 0


def test_c8_more_bits():
    assert explain("-1", "1", 4).error_bound == F(1, 15)
    assert explain("-1", "1", 8).error_bound == F(1, 255)
    assert explain("-1", "1", 16).error_bound == F(1, 65535)
    assert round(1 / 15, 4) == 0.0667 and round(1 / 255, 5) == 0.00392 and round(1 / 65535, 6) == 1.5e-5
    # the bound is reached: a value halfway between two codes
    for bits in (4, 8, 16):
        s, z = grid("-1", "1", bits)
        midway = s * (3 - z) + s / 2
        assert explain("-1", "1", bits, midway).error == s / 2


def test_c10_int4_vs_int8_step_ratio():
    ratio = scale("-1", "1", 4) / scale("-1", "1", 8)
    assert ratio == 17 == F(2**8 - 1, 2**4 - 1)
    assert ratio != 2


def test_round_half_up_ties_go_up():
    assert explain("0", "15", 4, "2.5").code == 3  # Python's round(2.5) would give 2
    assert explain("-15", "0", 4, "-2.5").code_unclipped == 13  # -2.5 -> -2, then + z = 15
    z = explain("-1", "1", 8).zero_point
    assert z == 128  # round(127.5) = 128


def test_exact_str():
    assert [exact_str(x) for x in (F(1, 10), F(-3, 5), F(2, 15), F(20), F(1, 40), F(0))] == [
        "0.1",
        "-0.6",
        "2/15",
        "20",
        "0.025",
        "0",
    ]


def test_to_dict_keys():
    d = to_dict(explain("-0.6", "0.9", 4, "0.35"))
    assert d["scale"] == 0.1 and d["zero_point"] == 6 and d["code"] == 10 and d["error"] == 0.05
    assert d["exact"]["reconstructed"] == "0.4"


@pytest.mark.parametrize(
    "args, param",
    [
        (("-1", "1", 0), "bits"),
        (("-1", "1", 17), "bits"),
        (("1", "-1", 4), "rmin"),
        (("abc", "1", 4), "rmin"),
        (("-1", "nan", 4), "rmax"),
        (("-1", "1", 4, "1e400"), "value"),
    ],
)
def test_explain_bad_input(args, param):
    with pytest.raises(InputError) as e:
        explain(*args)
    assert e.value.param == param


# ---------------------------------------------------------------- tensor quantizer (uniform.py)


def test_c5_c6_on_tensor_grid():
    qt = quantize(torch.tensor([0.9, 1.4, -5.0, 0.0]), bits=4, rmin=-0.6, rmax=0.9)
    assert qt.zero_point.item() == 6
    assert qt.codes.tolist() == [15, 15, 0, 6]  # saturates at the end codes, no wrap
    assert torch.allclose(dequantize(qt), torch.tensor([0.9, 0.9, -0.6, 0.0]))


def test_round_half_up_on_tensor():
    assert round_half_up(torch.tensor([2.5, -2.5, 0.5, -0.5])).tolist() == [3.0, -2.0, 1.0, 0.0]
    qt = quantize(torch.tensor([0.0, 2.5, 15.0]), bits=4)
    assert qt.codes.tolist() == [0, 3, 15]


@pytest.mark.parametrize("value", [0.3, -0.7, 0.0, 1e-30, 123456.789])
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_c7_constant_tensor_reconstructs_exactly(value, bits):
    x = torch.full((4, 8), value)
    qt = quantize(x, bits=bits)
    assert torch.isfinite(qt.scale).all()
    assert torch.equal(dequantize(qt), x)


def test_c7_constant_rows_next_to_varied_rows():
    x = torch.tensor([[0.3, 0.3, 0.3, 0.3], [-1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]])
    r_hat = dequantize(quantize(x, bits=4, axis=0))
    assert torch.equal(r_hat[0], x[0]) and torch.equal(r_hat[2], x[2])


def test_c7_constant_grid_is_chosen_on_purpose():
    # Not an epsilon floor (the spec: s = 2^-12 brings 0.3 back as ~0.00366) but s = |v|, code 1 (or 0).
    v = torch.tensor([0.3, -0.7, 0.0])
    s, z = qparams(v, v, 4)
    assert s.tolist() == [torch.tensor(0.3).item(), torch.tensor(0.7).item(), 1.0]
    assert z.tolist() == [0.0, 1.0, 0.0]
    assert torch.equal(s * (torch.clamp(round_half_up(v / s) + z, 0, 15) - z), v)


@pytest.mark.parametrize("bits, bound", [(4, 1 / 15), (8, 1 / 255), (16, 1 / 65535)])
def test_c8_tensor_worst_error(bits, bound):
    x = torch.linspace(-1, 1, 100_001, dtype=torch.float64)
    qt = quantize(x, bits=bits)
    assert qt.scale.item() == pytest.approx(2 * bound)
    err = (dequantize(qt) - x).abs().max().item()
    assert err <= bound * (1 + 1e-9)
    assert err >= bound * 0.9  # the bound is nearly reached on a dense grid


def test_c10_tensor_step_ratio():
    x = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    assert quantize(x, bits=4).scale.item() / quantize(x, bits=8).scale.item() == pytest.approx(17)


def test_codes_dtype_and_shapes():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    assert quantize(x, bits=8).codes.dtype == torch.uint8
    assert quantize(x, bits=16).codes.dtype == torch.int32
    assert quantize(x).scale.shape == ()
    assert quantize(x, axis=0).scale.shape == (6,)
    assert quantize(x, axis=1).scale.shape == (8,)
    assert quantize(x, group_size=4).scale.shape == (6, 2)
    assert quantize(x, axis=0, group_size=3).scale.shape == (8, 2)
    for qt in (quantize(x, axis=1), quantize(x, axis=0, group_size=2)):
        assert qt.codes.shape == x.shape and dequantize(qt).shape == x.shape


def test_per_channel_equals_per_tensor_on_each_channel():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    qt = quantize(x, bits=4, axis=1)
    for c in range(5):
        one = quantize(x[:, c, :].contiguous(), bits=4)
        assert torch.equal(qt.codes[:, c, :], one.codes)
        assert torch.equal(dequantize(qt)[:, c, :], dequantize(one))


def test_groupwise_along_a_middle_axis():
    x = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(3))
    qt = quantize(x, bits=4, axis=1, group_size=4)
    assert qt.scale.shape == (3, 5, 2)  # other axes, then groups of axis 1
    r_hat = dequantize(qt)
    for i, k, j in [(0, 0, 0), (2, 1, 3), (1, 1, 4)]:
        one = quantize(x[i, 4 * k : 4 * k + 4, j].contiguous(), bits=4)
        assert torch.equal(qt.codes[i, 4 * k : 4 * k + 4, j], one.codes)
        assert torch.equal(r_hat[i, 4 * k : 4 * k + 4, j], dequantize(one))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"bits": 0}, "bits"),
        ({"bits": 17}, "bits"),
        ({"bits": 1}, "bits"),
        ({"bits": 4, "group_size": 5}, "group_size"),
        ({"bits": 4, "group_size": 0}, "group_size"),
        ({"bits": 4, "axis": 2}, "axis"),
        ({"bits": 4, "rmin": 1.0, "rmax": -1.0}, "rmin"),
        ({"bits": 4, "rmin": float("nan"), "rmax": 1.0}, "rmin"),
    ],
)
def test_quantize_bad_input(kwargs, param):
    with pytest.raises(InputError) as e:
        quantize(torch.zeros(4, 8), **kwargs)
    assert e.value.param == param


def test_group_size_error_names_both_numbers():
    with pytest.raises(InputError) as e:
        quantize(torch.zeros(4, 8), bits=4, group_size=5)
    assert "5" in str(e.value) and "8" in str(e.value)


def test_quantize_refuses_nan_and_empty():
    with pytest.raises(InputError):
        quantize(torch.tensor([1.0, float("nan")]))
    with pytest.raises(InputError):
        quantize(torch.zeros(0))


BITS = st.sampled_from([2, 3, 4, 5, 6, 7, 8, 16])
FINITE = st.floats(-1000, 1000, allow_nan=False, allow_infinity=False, width=32)


def _tensor(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@settings(max_examples=150, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=FINITE), BITS)
def test_codes_in_range_and_error_within_half_step(a, bits):
    x = _tensor(a)
    qt = quantize(x, bits=bits)
    codes = qt.codes.to(torch.int64)
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    s = qt.scale.item()
    slack = 1e-3 * s + 1e-5 * x.abs().max().item()
    assert (dequantize(qt) - x).abs().max().item() <= s / 2 + slack


@settings(max_examples=100, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 6)), elements=FINITE),
    st.integers(1, 4),
    BITS,
)
def test_groupwise_equals_per_tensor_on_each_group(a, groups, bits):
    x = _tensor(np.tile(a, (1, groups)))  # last axis = groups * group_size
    g = a.shape[1]
    qt = quantize(x, bits=bits, group_size=g)
    r_hat = dequantize(qt)
    for row in range(x.shape[0]):
        for k in range(groups):
            part = x[row, k * g : (k + 1) * g].contiguous()
            one = quantize(part, bits=bits)
            assert torch.equal(qt.codes[row, k * g : (k + 1) * g], one.codes)
            assert torch.equal(r_hat[row, k * g : (k + 1) * g], dequantize(one))


@settings(max_examples=100, deadline=None)
@given(arrays(np.float32, st.integers(1, 32), elements=FINITE), BITS, FINITE, FINITE)
def test_calibration_range_saturates(a, bits, lo, hi):
    lo, hi = min(lo, hi), max(lo, hi)
    qt = quantize(_tensor(a), bits=bits, rmin=lo, rmax=hi)
    codes = qt.codes.to(torch.int64)
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1


def test_fake_quantize():
    x = torch.tensor([-1.0, -0.2, 0.4, 1.0])
    assert torch.equal(fake_quantize(x, bits=8), dequantize(quantize(x, bits=8)))


# ---------------------------------------------------------------- INT4 packing (pack.py)


def test_pack_low_nibble_first():
    assert pack_int4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert unpack_int4(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]


def test_pack_odd_length():
    packed = pack_int4(torch.tensor([3, 4, 5]))
    assert packed.tolist() == [0x43, 0x05]  # padded with a zero nibble
    assert unpack_int4(packed, 3).tolist() == [3, 4, 5]
    with pytest.raises(InputError):
        unpack_int4(packed, 5)


@pytest.mark.parametrize("codes", [torch.tensor([0, 16]), torch.tensor([-1, 3]), torch.tensor([0.5, 1.0])])
def test_pack_refuses_bad_codes(codes):
    with pytest.raises(InputError):
        pack_int4(codes)


@given(st.lists(st.integers(0, 15), min_size=0, max_size=65), st.integers(1, 3))
def test_pack_round_trip(values, rows):
    codes = torch.tensor([values] * rows, dtype=torch.uint8).reshape(rows, len(values))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (len(values) + 1) // 2)
    assert torch.equal(unpack_int4(packed, len(values)), codes)


def test_quantize_pack_dequantize_int4():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    qt = quantize(x, bits=4, group_size=8)
    qt.codes = unpack_int4(pack_int4(qt.codes), 32)
    assert torch.equal(dequantize(qt), fake_quantize(x, bits=4, group_size=8))
