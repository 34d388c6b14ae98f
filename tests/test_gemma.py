"""Gemma 2 and Gemma 3 against transformers (fp32): GeGLU, (1 + weight) sandwich norms, sqrt(hidden)-scaled
embeddings, query_pre_attn_scalar, attention and final logit soft-capping (Gemma 2), interleaved sliding
and global layers (a 20-token window, shorter than the prompts), Gemma 3's q/k norms and its second RoPE
base; the same checkpoints as GGUF files written the way convert_hf_to_gguf.py writes them (llama.cpp's
names, norms stored as 1 + weight); quantized at load, as a folder, under AWQ's scale folding, and TP=2."""

from __future__ import annotations

import copy
import json

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from model_helpers import paged_prefill_logits
from test_model_families import _folder, _gguf_name, _write_tensors_and_close, our_model
from test_model_vs_hf import check_logits, check_tensor_parallel_2_equals_1, greedy_hf, hf_model, prompt_ids
from tiny_models import save_tiny_gemma2, save_tiny_gemma3

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InputError
from pagedllm.model import decode_stack
from pagedllm.model.build import build_model
from pagedllm.model.loader import load_checkpoint, read_model_config, registry
from pagedllm.model.quantized_checkpoint import save_quantized

FP32 = torch.float32
SAVERS = {"gemma2": save_tiny_gemma2, "gemma3": save_tiny_gemma3}
# what a GGUF file can say: llama.cpp derives the attention scale from head_dim (below 27B) and runs
# Gemma 3's sliding layers at base 10000, five of every six
GGUF_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, rope_local_base_freq=10000.0, num_hidden_layers=6,
                   sliding_window_pattern=6),
}  # fmt: skip


def assert_close_on_average(got: torch.Tensor, want: torch.Tensor, rel: float = 0.05) -> None:
    """Quantized against float logits, on average: Gemma 2's final cap of 3 squeezes large logits, so the
    worst single entry moves where tanh is steep, far more than the typical one."""
    assert (got - want).abs().mean().item() < rel * want.abs().mean().item()


@pytest.fixture(scope="module", params=list(SAVERS))
def gemma_pair(request, tmp_path_factory):
    path = SAVERS[request.param](tmp_path_factory.mktemp(request.param), seed=2)
    return path, our_model(path), hf_model(path)


def test_gemma_configs(gemma_pair):
    path, ours, _ = gemma_pair
    c = ours.config
    assert c.gemma_norms and c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    assert c.query_pre_attn_scalar == 24 and c.sliding_window == 20 and not c.all_layers_sliding
    layer = ours.model.layers[0]
    assert layer.pre_feedforward_layernorm is not None and layer.self_attn.scale == 24**-0.5
    if c.architecture == "gemma2":
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (5.0, 3.0)
        assert c.layer_types == ["sliding_attention", "full_attention"] * 2 and c.rope_local_theta is None
    else:
        assert c.attn_logit_softcapping is None and c.qk_norm and c.rope_local_theta == 1000.0
        assert c.layer_types == registry.pattern_layer_types(5, 3)
        assert c.rope_theta == 100000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        # the local table has its own base and no scaling; the global one is scaled
        assert not torch.equal(ours.rotary_local.cos, ours.rotary.cos)


def test_gemma_logits_match_hf(gemma_pair):
    check_logits(gemma_pair, seed=8)  # 1, 15, 16, 17, 100 tokens (five windows), chunked over a cached prefix


def test_gemma_greedy_64_tokens_match_hf(gemma_pair):
    path, ours, ref = gemma_pair
    llm = LLM(model=str(path), dtype="fp32", num_kv_blocks=64, show_progress=False)
    # mixed layers: the global ones read every block, so none is freed
    assert llm.llm_engine.scheduler.kv_cache_manager.sliding_window is None
    for n in (17, 40):
        ids = prompt_ids(n, ours.config.vocab_size, 5 + n)
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy_hf(ref, ids, 64), n


def test_fused_stack_refuses_gemma(gemma_pair):
    _, ours, _ = gemma_pair
    assert ours.config.architecture in decode_stack.unsupported_reason(ours)


def test_gemma_features_refused_elsewhere_and_unknown_ones_for_gemma(tmp_path):
    gemma = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu_pytorch_tanh")
    assert read_model_config(_folder(tmp_path, **gemma, attn_logit_softcapping=50.0)).attn_logit_softcapping == 50
    with pytest.raises(InputError, match="attn_logit_softcapping=50.0 .* not supported for Qwen3ForCausalLM"):
        read_model_config(_folder(tmp_path, attn_logit_softcapping=50.0))
    with pytest.raises(InputError, match="unsupported hidden_act 'silu' for Gemma2ForCausalLM"):
        read_model_config(_folder(tmp_path, **{**gemma, "hidden_activation": "silu"}))
    with pytest.raises(InputError, match="use_bidirectional_attention=True .*bidirectional"):
        read_model_config(_folder(tmp_path, **gemma, use_bidirectional_attention=True))
    g3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh")
    scaled_local = {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(InputError, match="sliding_attention.rope_type 'linear' is not supported"):
        read_model_config(_folder(tmp_path, **g3, rope_parameters=scaled_local))


# ---------------------------------------------------------------- GGUF, as convert_hf_to_gguf.py writes it

_GEMMA_TO_GGUF = {v: k for k, v in registry.GGUF_GEMMA_LAYER_NAMES.items()}


def _gemma_gguf_name(hf: str) -> str:
    return _gguf_name(hf, _GEMMA_TO_GGUF)


def write_gemma_gguf(hf_path, out, linear_type=T.F32):
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    arch = "gemma3" if cfg["model_type"] == "gemma3_text" else "gemma2"
    w = gguf.GGUFWriter(str(out), arch)
    ints = {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
            "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim", "attention.value_length": "head_dim",
            "attention.sliding_window": "sliding_window"}  # fmt: skip
    for key, hf_key in ints.items():
        w.add_uint32(f"{arch}.{key}", cfg[hf_key])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            w.add_float32(f"{arch}.{key}", cfg[key])
    rope = cfg["rope_parameters"]
    w.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", rope)["rope_theta"])
    if arch == "gemma3":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["full_attention"]["factor"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    # Gemma's norms go in as 1 + weight (llama.cpp's plain RMSNorm then computes the same)
    weights = {n: t + 1 if n.endswith("norm.weight") else t for n, t in load_file(str(hf_path / "model.safetensors")).items()}
    _write_tensors_and_close(w, weights, _gemma_gguf_name, linear_type)
    return out


@pytest.fixture(scope="module", params=list(SAVERS))
def gguf_pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}-gguf")
    path = SAVERS[request.param](folder / "hf", seed=3, **GGUF_OVERRIDES[request.param])
    return path, write_gemma_gguf(path, folder / "model.gguf"), hf_model(path)


def test_gemma_gguf_loads_and_matches_hf(gguf_pair):
    hf_path, gguf_path, ref = gguf_pair
    ckpt = load_checkpoint(gguf_path, show_progress=False)
    want = read_model_config(hf_path)
    got = ckpt.config
    for field in ("architecture", "sliding_window", "layer_types", "query_pre_attn_scalar", "gemma_norms",
                  "hidden_act", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta",
                  "rope_theta", "rope_scaling", "qk_norm", "tie_word_embeddings"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field
    assert "model.layers.0.pre_feedforward_layernorm.weight" in ckpt.weights
    model = our_model(gguf_path)
    for n in (1, 17, 100):
        ids = prompt_ids(n, got.vocab_size, 11 + n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        assert (paged_prefill_logits(model, ids) - expected).abs().max().item() < 1e-3, n


def test_gemma_gguf_q8_0_served_from_its_blocks(gguf_pair, tmp_path):
    hf_path, _, _ = gguf_pair
    path = write_gemma_gguf(hf_path, tmp_path / "q8.gguf", T.Q8_0)
    native, _ = build_model(path, FP32, "gguf", show_progress=False)
    dequantized, _ = build_model(path, FP32, None, show_progress=False)
    ids = prompt_ids(40, native.config.vocab_size, 4)
    assert_close_on_average(paged_prefill_logits(native, ids), paged_prefill_logits(dequantized, ids))


# ---------------------------------------------------------------- quantized, calibrated, tensor-parallel


def test_gemma_int8_folder_round_trip(gemma_pair, tmp_path):
    path, ours, _ = gemma_pair
    model, config = build_model(path, FP32, "int8", show_progress=False)
    ids = prompt_ids(40, config.vocab_size, 8)
    got = paged_prefill_logits(model, ids)
    assert_close_on_average(got, paged_prefill_logits(ours, ids))
    loaded, cfg = build_model(save_quantized(model, tmp_path / "q", source=path), FP32, None, show_progress=False)
    assert cfg == config
    assert torch.equal(paged_prefill_logits(loaded, ids), got)


def test_awq_folds_its_scales_into_gemma_norms_exactly(gemma_pair):
    """AWQ divides the norm before q/k/v (and before the MLP: Gemma's pre_feedforward_layernorm) by its
    scales: for a (1 + weight) norm the whole factor, so the float layer computes what it did before."""
    from pagedllm.quantization.awq import awq_quantize_layer
    from pagedllm.quantization.calib import float_rotary, layer0_inputs, run_layer

    _, ours, _ = gemma_pair
    xs = layer0_inputs(ours, [torch.tensor(prompt_ids(24, ours.config.vocab_size, s)) for s in (1, 2)])
    rotary = float_rotary(ours)
    for layer in ours.model.layers[:3]:  # sliding and global layers (and Gemma 3's local RoPE)
        work = copy.deepcopy(layer).float()
        before = [run_layer(work, x, rotary) for x in xs]
        awq_quantize_layer(work, xs, rotary, bits=4, group_size=16, n_grid=4, block_objective=False)
        for x, b in zip(xs, before):
            torch.testing.assert_close(run_layer(work, x, rotary), b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_gemma_tensor_parallel_2_equals_1(gemma_pair):
    path, ours, _ = gemma_pair
    check_tensor_parallel_2_equals_1(path, ours.config.vocab_size)
