"""`pagedllm quant explain`: the spec's C5-C7 through --json, text output, bad input, --help."""

import json

import pytest
from cli_helpers import cli

GRID = ["--rmin", "-0.6", "--rmax", "0.9", "--bits", "4"]


def explain_json(capsys, *argv) -> dict:
    rc, out, err = cli(capsys, "quant", "explain", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_c5_interior_value(capsys):
    d = explain_json(capsys, *GRID, "--value", "0.35")
    assert d["scale"] == 0.1
    assert d["zero_point"] == 6
    assert d["code_unclipped"] == 10 and d["code"] == 10 and d["clipped"] is False
    assert d["reconstructed"] == 0.4
    assert d["error"] == 0.05 == d["error_bound"]
    assert d["exact"] == {
        "rmin": "-0.6",
        "rmax": "0.9",
        "scale": "0.1",
        "error_bound": "0.05",
        "value": "0.35",
        "reconstructed": "0.4",
        "error": "0.05",
    }


def test_c6_boundary_and_clip(capsys):
    top = explain_json(capsys, *GRID, "--value", "0.9")
    assert (top["code"], top["reconstructed"], top["error"]) == (15, 0.9, 0.0)
    beyond = explain_json(capsys, *GRID, "--value", "1.4")
    assert beyond["code_unclipped"] == 20 and beyond["code"] == 15 and beyond["clipped"] is True
    assert beyond["reconstructed"] == 0.9 and beyond["error"] == 0.5


def test_c7_constant(capsys):
    d = explain_json(capsys, "--rmin", "0.3", "--rmax", "0.3", "--bits", "4", "--value", "0.3")
    assert d["reconstructed"] == 0.3 and d["exact"]["reconstructed"] == "0.3"
    assert d["error"] == 0.0


def test_grid_without_value(capsys):
    d = explain_json(capsys, "--rmin", "-1", "--rmax", "1", "--bits", "8")
    assert d["zero_point"] == 128 and d["exact"]["scale"] == "2/255" and "code" not in d


def test_text_output(capsys):
    rc, out, _ = cli(capsys, "quant", "explain", *GRID, "--value", "1.4")
    assert rc == 0
    assert "= 0.1" in out and "z = round(-r_min / s) = round(6) = 6" in out
    assert "clip(20, 0, 15) = 15" in out and "saturates at 15" in out
    assert "= 0.5" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rmin", "-1", "--rmax", "1", "--bits", "0"], ["bits", "0"]),
        (["--rmin", "-1", "--rmax", "1", "--bits", "17"], ["bits", "17"]),
        (["--rmin", "0.9", "--rmax", "-0.6", "--bits", "4"], ["rmin 0.9", "rmax -0.6"]),
        (["--rmin", "x", "--rmax", "1", "--bits", "4"], ["'x'"]),
        ([*GRID, "--value", "inf"], ["value", "'inf'"]),
        (["--rmin", "-1", "--rmax", "1", "--bits", "four"], ["--bits"]),
        (["--rmax", "1", "--bits", "4"], ["--rmin"]),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, words):
    rc, out, err = cli(capsys, "quant", "explain", *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("pagedllm")
    assert "Traceback" not in out + err
    for w in words:
        assert w in err


def test_help(capsys):
    rc, out, _ = cli(capsys, "quant", "explain", "--help")
    assert rc == 0 and "examples:" in out and "2^b - 1" in out
    rc, out, _ = cli(capsys, "quant")
    assert rc == 0 and "explain" in out
