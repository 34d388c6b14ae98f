"""`pagedllm env` and `pagedllm build-kernels` as a user runs them, in a subprocess under PAGEDLLM_CPU_ISA.

PAGEDLLM_CPU_ISA=avx2 is valid on every x86 CPU this project runs on, so the tier, the op table and the
defaults are the same on every such machine; the tests skip where the CPU has no avx2 (or is not x86).
Kernels go to the usual cache (~/.cache/pagedllm/kernels or PAGEDLLM_KERNEL_CACHE): a first run builds
them, as `pagedllm build-kernels` would.
"""

from __future__ import annotations

import json
import os
import platform as std_platform
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import kernels, ops, platform

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # a first run compiles every avx2 kernel


def detected_tier() -> str:
    if std_platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    return platform.tier_of(platform._read_cpuinfo()[1])


pytestmark = pytest.mark.skipif(detected_tier() == "none", reason="this machine is not x86 with avx2")


def cli(*args: str, isa: str | None = "avx2") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (platform.ISA_ENV, "PAGEDLLM_NO_CPU_KERNEL")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if isa is not None:
        env[platform.ISA_ENV] = isa
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def env_json() -> dict:
    r = cli("env", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_env_json_tier(env_json):
    assert env_json["tier"] == "avx2"
    assert env_json["detected_tier"] == detected_tier()
    assert env_json["capped_by"] == (platform.ISA_ENV if detected_tier() != "avx2" else None)
    for flag in ("avx2", "fma", "f16c"):
        assert env_json["features"][flag] is True


def test_env_json_every_op_has_a_backend(env_json):
    assert list(env_json["ops"]) == list(ops.OPS)
    for op, choice in env_json["ops"].items():
        assert isinstance(choice["backend"], str) and choice["backend"], op
        assert choice["detail"], op


def test_env_json_avx2_never_picks_higher_tier_backends(env_json):
    chosen = {op: c["backend"] for op, c in env_json["ops"].items()}
    assert chosen["quantized_linear"] in ("avx2", "torch-packed")
    assert chosen["decoder_stack"] == ("fused-avx2" if chosen["quantized_linear"] == "avx2" else "torch")
    assert chosen["linear"] != "onednn-prepacked"
    assert chosen["attention_prefill"] == "sdpa"
    for op in ("layer_ops", "attention_decode", "write_kv", "argmax"):
        assert chosen[op] in ("cpp-avx2", "torch"), op


def test_env_json_defaults_on_avx2(env_json):
    d = env_json["defaults"]
    assert d["dtype"] == "fp32"
    assert d["kv_cache_dtype"] == "fp32"
    gguf = env_json["ops"]["quantized_linear"]["backend"] in ("amx", "avx2")
    assert d["gguf_quantization"] == ("gguf" if gguf else "none")


def test_env_json_kernels(env_json):
    assert set(env_json["kernels"]) == set(kernels.KERNELS)
    assert env_json["kernels"]["woq_amx"] == "not for this tier (needs amx)"
    if env_json["ops"]["decoder_stack"]["backend"] == "fused-avx2":  # its avx2 build, without the AMX parts
        assert env_json["kernels"]["decode_stack"] == "built"
    # `env` builds what the table picks: a kernel backend in the table means that kernel is built
    if env_json["ops"]["quantized_linear"]["backend"] == "avx2":
        assert env_json["kernels"]["woq_avx2"] == "built"
    if env_json["ops"]["layer_ops"]["backend"] != "torch":
        assert env_json["kernels"]["layer_ops"] == "built"


def test_env_text_names_tier_and_every_op():
    r = cli("env")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    tier_line = next(line for line in lines if line.startswith("tier "))
    assert tier_line.split()[1] == "avx2"
    if detected_tier() != "avx2":
        assert platform.ISA_ENV in tier_line
    op_lines = {
        line.split()[0]: line.split()[1] for line in lines if line.split() and line.split()[0] in ops.OPS
    }
    assert set(op_lines) == set(ops.OPS)
    assert op_lines["decoder_stack"] in ("fused-avx2", "torch")
    assert any(line.startswith("dtype auto") and " fp32 " in line for line in lines)


@pytest.mark.parametrize("value", ["bogus", "amx9"])
def test_env_bad_isa_is_one_line_and_exit_2(value):
    r = cli("env", "--json", isa=value)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr
    assert err[0].startswith("pagedllm env: error: ")
    assert platform.ISA_ENV in err[0] and value in err[0]


def test_build_kernels_twice_second_is_cached():
    first = cli("build-kernels")
    assert first.returncode == 0, first.stdout + first.stderr
    second = cli("build-kernels")
    assert second.returncode == 0, second.stdout + second.stderr
    lines = dict(line.split(None, 1) for line in second.stdout.splitlines() if line.strip())
    assert set(lines) == set(kernels.KERNELS), second.stdout
    for name, rest in lines.items():
        if kernels.KERNELS[name].min_tier in (None, "avx2"):
            assert rest == "built for avx2 (cached)", (name, rest)
        else:
            assert rest.startswith("skipped: not for this tier"), (name, rest)
    assert "compiling" not in second.stderr


# ---- env --model: what runs for one model, as the engine builds it ---------------------------------------


def engine_runs_the_stack(model: str) -> bool:
    """Whether an engine of this process (the CPU's own tier, as `cli(..., isa=None)`) runs the fused stack."""
    from pagedllm import LLM

    llm = LLM(model=model, kv_cache_memory="32MiB")
    try:
        return llm.llm_engine.model.decode_stack is not None
    finally:
        llm.llm_engine.shutdown()


def env_model(model: str) -> dict:
    r = cli("env", "--model", model, "--json", isa=None)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["model"]


def test_env_model_default_reports_the_decoder_path_that_runs():
    info = env_model("default")
    assert info["architecture"] == "llama"
    fused = engine_runs_the_stack("default")
    assert (info["decoder_stack"]["backend"] != "torch") == fused, info
    if not fused:
        assert "layer loop" in info["decoder_stack"]["detail"]
    if info["quantization"] == "gguf":  # served from its blocks: every linear on a kernel
        assert sum(info["quantized_linear"].values()) >= 30 * 4 and "torch" not in info["quantized_linear"]


def test_env_model_float32_folder_runs_the_layer_loop_and_says_why(tmp_path):
    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    r = cli("env", "--model", str(folder), "--dtype", "float32", "--json", isa=None)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)["model"]
    assert info["dtype"] == "float32" and info["quantization"] == "none" and info["quantized_linear"] == {}
    assert info["decoder_stack"]["backend"] == "torch"
    # the reason names the layer and what the stack cannot call (or that this machine has no stack)
    detail = info["decoder_stack"]["detail"]
    assert "layer 0 qkv_proj is a Linear" in detail or "no fused decoder stack" in detail, detail
    text = cli("env", "--model", str(folder), "--dtype", "float32", isa=None)
    assert text.returncode == 0 and "decoder_stack  torch: the model's layer loop" in text.stdout


def test_env_model_bad_path_is_one_line_and_exit_2(tmp_path):
    r = cli("env", "--model", str(tmp_path / "missing"), isa=None)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "missing" in r.stderr
