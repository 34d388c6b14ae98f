"""`pagedllm quantize`: RTN folders that load back identically, and bad input (exit 2, one line)."""

import json

import pytest
import torch
from cli_helpers import cli
from model_helpers import paged_prefill_logits
from tiny_models import save_tiny_llama

from pagedllm.model.build import build_model
from pagedllm.model.loader import default_model_path
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.quantization.linear import QuantLinear


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", attention_bias=True)


@pytest.mark.parametrize("bits,group,scheme", [(4, "64", "int4-g64"), (8, None, "int8")])
def test_rtn_folder_loads_to_the_same_model_as_quantizing_at_load(
    capsys, tmp_path, tiny, bits, group, scheme
):
    args = [
        "quantize",
        "--model",
        str(tiny),
        "--method",
        "rtn",
        "--bits",
        str(bits),
        "--out",
        str(tmp_path / "q"),
    ]
    rc, out, err = cli(capsys, *args, *(["--group-size", group] if group else []), "--quiet")
    assert rc == 0, err
    assert "28 linear layers rtn" in out  # 4 layers x 7
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "pagedllm",
        "bits": bits,
        "group_size": int(group) if group else None,
        "method": "rtn",
    }
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    loaded, _ = build_model(tmp_path / "q", torch.bfloat16, None, show_progress=False)
    at_load, _ = build_model(tiny, torch.bfloat16, scheme, show_progress=False)
    ids = list(range(10, 40))
    assert torch.equal(paged_prefill_logits(loaded, ids), paged_prefill_logits(at_load, ids))


def test_default_gguf_model_quantizes_with_its_tokenizer(capsys, tmp_path):
    out_dir = tmp_path / "smollm2-int4"
    rc, out, err = cli(
        capsys, "quantize", "--model", "default", "--bits", "4", "--out", str(out_dir), "--quiet"
    )
    assert rc == 0, err
    loaded, cfg = build_model(out_dir, torch.bfloat16, None, show_progress=False)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 7 * cfg.num_layers
    text = "The capital of France is"
    assert Tokenizer.from_checkpoint(out_dir).encode(text) == Tokenizer.from_checkpoint(
        default_model_path()
    ).encode(text)
    at_load, _ = build_model(default_model_path(), torch.bfloat16, "int4", show_progress=False)
    ids = Tokenizer.from_checkpoint(out_dir).encode(text)
    assert torch.equal(paged_prefill_logits(loaded, ids), paged_prefill_logits(at_load, ids))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--method", "awq"], "--method awq needs --calib FILE"),
        (
            ["--method", "gptq", "--calib", "/nonexistent/calib.txt"],
            "calibration file /nonexistent/calib.txt does not exist",
        ),
        (["--group-size", "48"], "group_size 48 does not divide in_features 64"),
        (["--bits", "3"], "invalid choice: 3"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, tiny, extra, message):
    rc, out, err = cli(
        capsys, "quantize", "--model", str(tiny), "--out", str(tmp_path / "q"), "--quiet", *extra
    )
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_too_short_calibration_file_exits_2(capsys, tmp_path, tiny):
    calib = tmp_path / "calib.txt"
    calib.write_text("a few words only")
    rc, _, err = cli(capsys, "quantize", "--model", str(tiny), "--method", "awq", "--calib", str(calib),
                     "--out", str(tmp_path / "q"), "--quiet")  # fmt: skip
    assert rc == 2 and "calibration file" in err, err


def test_out_folder_must_be_empty(capsys, tmp_path, tiny):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "x").write_text("")
    rc, _, err = cli(capsys, "quantize", "--model", str(tiny), "--out", str(tmp_path / "q"), "--quiet")
    assert rc == 2 and "not empty" in err


def test_calibration_says_how_much_work_it_is_before_it_starts(capsys, tmp_path, tiny):
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    rc, out, err = cli(capsys, "quantize", "--model", str(tiny), "--method", "gptq", "--calib", str(calib),
                       "--num-samples", "2", "--seq-len", "16", "--out", str(tmp_path / "q"))  # fmt: skip
    assert rc == 0, err
    assert (
        "gptq: calibrating 28 linears in 4 decoder layers, one layer at a time, on 2 samples x 16 tokens"
        in err
    )
    assert "decoder layer" in err  # the bar counts what it says
