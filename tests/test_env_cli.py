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
    assert chosen["quantized_linear"] in ("avx2", "torch")
    assert chosen["decoder_stack"] == ("fused-avx2" if chosen["quantized_linear"] == "avx2" else "per-op")
    assert chosen["linear"] != "onednn-prepacked"
    assert chosen["attention_prefill"] == "torch"
    for op in ("layer_ops", "attention_decode", "write_kv", "argmax"):
        assert chosen[op] in ("cpp-avx2", "torch"), op


def test_env_json_defaults_on_avx2(env_json):
    d = env_json["defaults"]
    assert d["dtype"] == "fp32"
    assert d["kv_cache_dtype"] == "fp32"
    gguf = env_json["ops"]["quantized_linear"]["backend"] != "torch"
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
    assert op_lines["decoder_stack"] in ("fused-avx2", "per-op")
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
