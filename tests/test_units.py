"""parse_size / format_size: binary units are powers of 1024, decimal ones powers of 1000, never mixed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.errors import InputError
from pagedllm.units import format_size, parse_size

GiB, MiB = 1024**3, 1024**2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 85_899_345_920),
        ("26GiB", 26 * GiB),
        ("40GB", 40_000_000_000),
        ("512MiB", 536_870_912),
        ("1.5GiB", 1_610_612_736),
        ("6.5GiB", 6_979_321_856),
        ("12345", 12345),
        ("0", 0),
        ("10B", 10),
        ("1 KiB", 1024),
        ("2.5KB", 2500),
        ("1TiB", 1024**4),
        ("1TB", 10**12),
        ("4gib", 4 * GiB),  # units are case-insensitive
        (".5KiB", 512),
        ("3,355,443,200", 3_355_443_200),
        ("1_000", 1000),
        (12345, 12345),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_drops_fractions_of_a_byte():
    assert parse_size("1.1KiB") == 1126  # 1126.4 bytes


@pytest.mark.parametrize(
    "text", ["-1GiB", "-5", "", "   ", "abc", "12XB", "1.2.3GiB", "GiB", "1 G", "nan", "inf"]
)
def test_parse_size_rejects(text):
    with pytest.raises(InputError) as e:
        parse_size(text, param="memory")
    assert repr(text) in str(e.value)  # names the value the user typed
    assert e.value.param == "memory"


@pytest.mark.parametrize("value", [-1, True, None])
def test_parse_size_rejects_non_sizes(value):
    with pytest.raises(InputError):
        parse_size(value)


@pytest.mark.parametrize(
    "n, kwargs, expected",
    [
        (3_355_443_200, {}, "3.125 GiB"),
        (3_355_443_200, {"binary": False}, "3.355 GB"),
        (1_572_864, {}, "1.5 MiB"),
        (786_432, {"unit": "MiB"}, "0.75 MiB"),
        (819_200, {"unit": "MiB"}, "0.781 MiB"),
        (13_107_200, {}, "12.5 MiB"),
        (80 * GiB, {}, "80 GiB"),
        (69 * GiB + GiB // 2, {}, "69.5 GiB"),
        (40_000_000_000, {"binary": False}, "40 GB"),
        (0, {}, "0 B"),
        (512, {}, "512 B"),
        (1024, {}, "1 KiB"),
        (1000, {"binary": False}, "1 KB"),
        (12345, {"unit": "B"}, "12345 B"),
    ],
)
def test_format_size(n, kwargs, expected):
    assert format_size(n, **kwargs) == expected


def test_format_size_rejects_mixed_unit():
    with pytest.raises(InputError):
        format_size(GiB, binary=True, unit="GB")


@given(st.integers(min_value=0, max_value=2**60))
def test_units_never_mixed(n):
    binary, decimal = format_size(n), format_size(n, binary=False)
    assert binary.endswith(" B") or binary.endswith("iB")
    assert "iB" not in decimal


@given(st.integers(min_value=0, max_value=2**50), st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_parse_size_whole_units(n, unit):
    mult = {"KiB": 1024, "MiB": MiB, "GiB": GiB, "KB": 1000, "MB": 10**6, "GB": 10**9}[unit]
    assert parse_size(f"{n}{unit}") == n * mult
