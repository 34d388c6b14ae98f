"""The model families (model/loader/registry.py): Qwen3 and Phi-3 (fused storage, partial rotary, LongRoPE)
against transformers, from safetensors and GGUF; refusals of unknown architectures and of features no family
implements; TP and quantized Qwen3."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from model_helpers import paged_prefill_logits
from test_model_vs_hf import check_logits, check_tensor_parallel_2_equals_1, greedy_hf, hf_model, prompt_ids
from tiny_models import save_tiny_llama, save_tiny_phi3, save_tiny_qwen3

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InputError
from pagedllm.model import decode_stack
from pagedllm.model.build import build_model, model_class
from pagedllm.model.loader import load_checkpoint, read_model_config, registry
from pagedllm.model.quantized_checkpoint import save_quantized

FP32 = torch.float32


def our_model(path):
    ckpt = load_checkpoint(path, show_progress=False)
    return model_class(ckpt.config).from_weights(ckpt.config, ckpt.weights, FP32)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_pair(qwen3_path):
    return qwen3_path, our_model(qwen3_path), hf_model(qwen3_path)


def test_registry_entries_are_consistent():
    for a in registry.ARCHITECTURES:
        assert registry.get(a.name) is a
        assert registry.from_hf(a.hf_architectures[0], "x") is a
        if a.gguf_architecture:
            # Mixtral's files are arch llama with llama.expert_count: the metadata tells them apart
            meta = {f"{a.gguf_architecture}.expert_count": 8 if a.moe else 0}
            assert registry.from_gguf(a.gguf_architecture, "x", meta) is a
    assert registry.from_gguf("llama", "x") is registry.get("llama")
    assert registry.get("qwen3").features == ("q/k norm", "sliding window")
    assert registry.get("qwen2").features == ("q/k/v bias", "sliding window")
    assert registry.get("llama").features == ()


def test_qwen3_config(qwen3_path):
    c = read_model_config(qwen3_path)
    assert c.architecture == "qwen3" and c.qk_norm and c.head_dim == 24
    assert not c.attention_bias and not c.o_proj_bias and c.tie_word_embeddings
    model = our_model(qwen3_path)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (24,) and attn.k_norm.weight.shape == (24,)
    # a Llama has no q/k norm modules at all
    assert read_model_config(save_tiny_llama(qwen3_path.parent / "llama")).qk_norm is False


def test_qwen3_logits_match_hf(qwen3_pair):
    check_logits(qwen3_pair, seed=3)  # 1, 15, 16, 17, 100 tokens, and chunked over a cached prefix


def test_qwen3_greedy_64_tokens_match_hf(qwen3_pair):
    path, ours, ref = qwen3_pair
    llm = LLM(model=str(path), dtype="fp32", num_kv_blocks=64, show_progress=False)
    ids = prompt_ids(17, ours.config.vocab_size, 5)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy_hf(ref, ids, 64)


def test_fused_stack_refuses_the_q_k_norm(qwen3_pair):
    _, ours, _ = qwen3_pair
    assert "qwen3" in decode_stack.unsupported_reason(ours)
    # and even as a fused architecture, the layer's children (q_norm, k_norm) send it to the layer loop
    ours.config.architecture = "qwen2"
    try:
        reason = decode_stack.unsupported_reason(ours)
    finally:
        ours.config.architecture = "qwen3"
    assert "k_norm" in reason and "q_norm" in reason


# ---------------------------------------------------------------- GGUF (llama.cpp's names and metadata)

_TO_GGUF = {v: k for k, v in registry.GGUF_LAYER_NAMES.items()}


def _gguf_name(hf: str, to_gguf: dict[str, str] = _TO_GGUF) -> str:
    """An HF tensor name under llama.cpp's name (to_gguf: a family's HF -> GGUF layer-name table)."""
    glob = {v: k for k, v in registry.GGUF_GLOBAL_NAMES.items()}
    if hf in glob:
        return glob[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{to_gguf[module]}.{kind}"


def write_qwen3_gguf(hf_path, out, linear_type=T.F32, extra_meta=None):
    """What convert_hf_to_gguf.py writes for Qwen3 (no Q/K permutation), linears as `linear_type`."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    weights = load_file(str(hf_path / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "qwen3")
    a = "qwen3"
    w.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(f"{a}.attention.key_length", cfg["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", cfg["head_dim"])
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    for key, value in (extra_meta or {}).items():
        w.add_uint32(key, value)
    tensors = {n: t for n, t in weights.items() if n != "lm_head.weight"}  # tied: no output.weight
    _write_tensors_and_close(w, tensors, _gguf_name, linear_type)
    return out


def _write_tensors_and_close(w, weights: dict, gguf_name, linear_type) -> None:
    """Every HF-named tensor under its llama.cpp name (linears, and stacked [experts, out, in] ones, in
    `linear_type`; a MoE router stays F32, as llama.cpp keeps it), then the file."""
    for name, t in weights.items():
        array = t.float().numpy()
        router = name.endswith(".mlp.gate.weight")
        if array.ndim in (2, 3) and "embed" not in name and not router and linear_type != T.F32:
            w.add_tensor(gguf_name(name), quantize(array, linear_type), raw_dtype=linear_type)
        else:
            w.add_tensor(gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_gguf_loads_and_matches_hf(qwen3_pair, tmp_path):
    path, ours, ref = qwen3_pair
    gguf_path = write_qwen3_gguf(path, tmp_path / "qwen3.gguf")
    ckpt = load_checkpoint(gguf_path, show_progress=False)
    # the same config, but for what GGUF stores otherwise (eps as float32) or this writer leaves out (bos)
    same = dict(rms_norm_eps=ours.config.rms_norm_eps, bos_token_id=ours.config.bos_token_id)
    assert dataclasses.replace(ckpt.config, **same) == ours.config
    assert ckpt.config.rms_norm_eps == pytest.approx(ours.config.rms_norm_eps)
    for name, p in ours.state_dict().items():
        if name in ckpt.weights:
            assert torch.equal(ckpt.weights[name], p), name
    assert "model.layers.2.self_attn.k_norm.weight" in ckpt.weights
    model = our_model(gguf_path)
    for n in (1, 17, 100):
        ids = prompt_ids(n, ours.config.vocab_size, 11 + n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        assert (paged_prefill_logits(model, ids) - expected).abs().max().item() < 1e-3, n


def test_qwen3_gguf_q8_0_served_from_its_blocks(qwen3_path, tmp_path):
    gguf_path = write_qwen3_gguf(qwen3_path, tmp_path / "q8.gguf", T.Q8_0)
    native, _ = build_model(gguf_path, FP32, "gguf", show_progress=False)
    dequantized, _ = build_model(gguf_path, FP32, None, show_progress=False)
    assert native.model.layers[0].self_attn.q_norm is not None
    ids = prompt_ids(20, native.config.vocab_size, 4)
    got, want = paged_prefill_logits(native, ids), paged_prefill_logits(dequantized, ids)
    # int8 activations against float ones: close, not equal
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


# ---------------------------------------------------------------- refusals


def _folder(tmp_path, **overrides):
    """A config-only folder: the config is read (and refused) before any weight."""
    base = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
    )
    base.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(base))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(architectures=["Gemma3nForCausalLM"]), "unsupported architecture 'Gemma3nForCausalLM'"),
        (dict(architectures=["DeepseekV3ForCausalLM"]), "unsupported architecture 'DeepseekV3ForCausalLM'"),
        (dict(architectures=None, model_type="phimoe"), "unsupported architecture 'phimoe'"),
        (dict(num_experts=8), "num_experts=8 .* not supported for Qwen3ForCausalLM"),
        (
            dict(architectures=["MistralForCausalLM"], num_local_experts=8),
            "num_local_experts=8 .* not supported for MistralForCausalLM",
        ),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (dict(architectures=["LlamaForCausalLM"], use_qk_norm=True), "use_qk_norm=True"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ],
)
def test_unknown_architecture_or_feature_is_refused(tmp_path, overrides, message):
    with pytest.raises(InputError, match=message):
        read_model_config(_folder(tmp_path, **overrides))


def test_harmless_feature_keys_are_accepted(tmp_path):
    c = read_model_config(_folder(tmp_path, num_experts=0, partial_rotary_factor=1.0, sliding_window=None))
    assert c.architecture == "qwen3" and c.max_position_embeddings == 512


def test_sliding_window_layers_follow_the_family_rule(tmp_path):
    # Qwen: windows from max_window_layers on, only with use_sliding_window; the context is not capped
    c = read_model_config(_folder(tmp_path, use_sliding_window=True, sliding_window=64, max_window_layers=1))
    assert c.max_position_embeddings == 512 and c.sliding_window == 64
    assert c.layer_types == ["full_attention", "sliding_attention"] and not c.all_layers_sliding
    assert read_model_config(_folder(tmp_path, sliding_window=64)).sliding_window is None
    # layer_types written by transformers 5 win over the rule
    listed = ["sliding_attention", "sliding_attention"]
    c = read_model_config(_folder(tmp_path, sliding_window=64, layer_types=listed))
    assert c.layer_types == listed and c.all_layers_sliding
    # a window as wide as the context never slides: plain attention, and the fused stack stays possible
    assert read_model_config(_folder(tmp_path, sliding_window=512, layer_types=listed)).sliding_window is None
    with pytest.raises(InputError, match="layer_types must list 2 of full_attention, sliding_attention"):
        read_model_config(_folder(tmp_path, sliding_window=64, layer_types=["sliding_attention"]))


def test_gguf_unknown_architecture_and_moe_are_refused(qwen3_path, tmp_path):
    path = write_qwen3_gguf(qwen3_path, tmp_path / "moe.gguf", extra_meta={"qwen3.expert_count": 8})
    with pytest.raises(InputError, match=r"qwen3.expert_count=8 \(a mixture-of-experts block\)"):
        read_model_config(path)
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3n")
    w.add_uint32("gemma3n.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="unsupported architecture 'gemma3n'"):
        read_model_config(tmp_path / "g.gguf")


# ---------------------------------------------------------------- quantized and tensor-parallel Qwen3


def test_qwen3_int8_at_load_and_its_folder_round_trip(qwen3_path, tmp_path):
    model, _ = build_model(qwen3_path, FP32, "int8", show_progress=False)
    ids = prompt_ids(17, model.config.vocab_size, 8)
    got = paged_prefill_logits(model, ids)
    want = paged_prefill_logits(our_model(qwen3_path), ids)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    out = save_quantized(model, tmp_path / "q", source=qwen3_path)
    loaded, cfg = build_model(out, FP32, None, show_progress=False)
    assert cfg.architecture == "qwen3" and cfg.qk_norm
    assert torch.equal(paged_prefill_logits(loaded, ids), got)


@pytest.mark.slow
def test_qwen3_tensor_parallel_2_equals_1(qwen3_path):
    check_tensor_parallel_2_equals_1(qwen3_path, 49152)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_qwen3_pagedllm_quantize_folder_loads(capsys, qwen3_path, tmp_path, method):
    from cli_helpers import cli

    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    rc, _, err = cli(capsys, "quantize", "--model", str(qwen3_path), "--method", method, "--calib", str(calib),
                     "--bits", "4", "--group-size", "32", "--num-samples", "2", "--seq-len", "16",
                     "--out", str(tmp_path / "q"), "--quiet")  # fmt: skip
    assert rc == 0, err
    loaded, cfg = build_model(tmp_path / "q", FP32, None, show_progress=False)
    assert cfg.qk_norm and loaded.model.layers[0].self_attn.q_norm is not None
    ids = prompt_ids(17, cfg.vocab_size, 9)
    got, want = paged_prefill_logits(loaded, ids), paged_prefill_logits(our_model(qwen3_path), ids)
    assert torch.isfinite(got).all()
    # 4-bit weights of a random model: only a sanity bound (the q/k norm is applied, not dropped)
    assert (got - want).abs().max().item() < 0.5 * want.abs().max().item()


# ---------------------------------------------------------------- Phi-3 / Phi-4-mini

# LongRoPE over a short original context, so 100-token prompts stay within it and generation crosses it
PHI3_ORIGINAL_MAX = 128
_LONGROPE = dict(
    partial_rotary_factor=0.75,
    original_max_position_embeddings=PHI3_ORIGINAL_MAX,
    rope_scaling={
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
    },
)
PHI3_VARIANTS = {
    "plain": {},
    "partial": dict(partial_rotary_factor=0.75),  # Phi-4-mini's factor: 12 of 16 dims turn
    "longrope": _LONGROPE,
}


@pytest.fixture(scope="module", params=list(PHI3_VARIANTS))
def phi3_pair(request, tmp_path_factory):
    path = save_tiny_phi3(
        tmp_path_factory.mktemp(f"phi3-{request.param}"), seed=4, **PHI3_VARIANTS[request.param]
    )
    return path, our_model(path), hf_model(path)


def test_phi3_config_and_split_weights(phi3_pair):
    path, ours, ref = phi3_pair
    c = ours.config
    assert c.architecture == "phi3" and c.head_dim == 16 and not c.attention_bias
    partial = "plain" not in path.name
    assert c.rotary_dim == (12 if partial else None)
    assert ours.rotary.cos.shape[-1] == (12 if partial else 16)
    # the fused tensors arrive split, row for row
    hf = ref.state_dict()
    qkv = hf["model.layers.1.self_attn.qkv_proj.weight"]
    mine = ours.state_dict()
    assert torch.equal(torch.cat([mine[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]), qkv)
    gate_up = hf["model.layers.2.mlp.gate_up_proj.weight"]
    assert torch.equal(
        torch.cat([mine[f"model.layers.2.mlp.{x}_proj.weight"] for x in ("gate", "up")]), gate_up
    )
    if "longrope" in path.name:
        assert c.rope_scaling["rope_type"] == "longrope"
        assert c.rope_scaling["original_max_position_embeddings"] == PHI3_ORIGINAL_MAX
        assert c.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(128)) ** 0.5)


def test_phi3_logits_match_hf(phi3_pair):
    check_logits(phi3_pair, seed=6)  # 1, 15, 16, 17, 100 tokens, and chunked over a cached prefix


def greedy_hf_kept_cache(ref, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' forward over its kept cache (generate() for Phi-3 drops the cache
    at the step crossing original_max_position_embeddings and recomputes everything with the long factors;
    layers/rotary.py's docstring says why pagedllm, like vLLM, does not)."""
    from transformers import DynamicCache

    cache, out, step = DynamicCache(), [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = ref(input_ids=step, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def test_phi3_greedy_64_tokens_match_hf(phi3_pair):
    path, ours, ref = phi3_pair
    llm = LLM(model=str(path), dtype="fp32", num_kv_blocks=64, show_progress=False)
    longrope = "longrope" in path.name
    # longrope: a 100-token prompt within the original context, 64 tokens past it (positions 100-163)
    n = 100 if longrope else 17
    ids = prompt_ids(n, ours.config.vocab_size, 5)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    got = out[0].outputs[0].token_ids
    want = greedy_hf(ref, ids, 64)
    if not longrope:
        assert got == want
        return
    within = PHI3_ORIGINAL_MAX - n + 1  # tokens chosen from positions below original_max
    assert got[:within] == want[:within]
    assert got == greedy_hf_kept_cache(ref, ids, 64)


@pytest.mark.parametrize("phi3_pair", ["longrope"], indirect=True)  # that variant only, nothing skipped
def test_longrope_tables_switch_at_the_original_context(phi3_pair):
    path, ours, ref = phi3_pair
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    hf_cfg = ref.config
    short, scale = _compute_longrope_parameters(hf_cfg)
    long, _ = _compute_longrope_parameters(hf_cfg, seq_len=PHI3_ORIGINAL_MAX + 1)
    for pos, inv in ((0, short), (PHI3_ORIGINAL_MAX - 1, short), (PHI3_ORIGINAL_MAX, long), (300, long)):
        f = pos * inv
        want = torch.cat((f, f)).cos() * scale
        assert torch.allclose(ours.rotary.cos[pos], want, atol=1e-6), pos


def test_fused_stack_refuses_partial_rotary(phi3_pair):
    path, ours, _ = phi3_pair
    assert "phi3" in decode_stack.unsupported_reason(ours)
    ours.config.architecture = "llama"  # even as a fused architecture, the partial rotary is refused
    try:
        reason = decode_stack.unsupported_reason(ours)
    finally:
        ours.config.architecture = "phi3"
    # the plain variant has nothing the stack lacks (its unmerged q, k, v are taken as they are): no reason
    assert ("partial rotary" in (reason or "")) == ("plain" not in path.name), reason


def test_phi3_partial_rotary_refused_for_other_families_only(tmp_path):
    c = read_model_config(_folder(tmp_path, architectures=["Phi3ForCausalLM"], model_type="phi3",
                                  head_dim=None, partial_rotary_factor=0.75))  # fmt: skip
    assert c.architecture == "phi3" and c.head_dim == 16 and c.rotary_dim == 12
    with pytest.raises(InputError, match="partial_rotary_factor=0.75 .* not supported for Qwen3ForCausalLM"):
        read_model_config(_folder(tmp_path, rope_parameters={"partial_rotary_factor": 0.75}))


def _phi3_gguf_name(hf: str) -> str:
    hf = hf.replace("self_attn.qkv_proj", "self_attn.q_proj").replace("mlp.gate_up_proj", "mlp.up_proj")
    name = _gguf_name(hf)
    return name.replace("attn_q.", "attn_qkv.")


def write_phi3_gguf(hf_path, out, linear_type=T.F32, longrope=False):
    """What convert_hf_to_gguf.py writes for Phi-3: attn_qkv and ffn_up ([gate; up]) as stored, unpermuted."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    weights = load_file(str(hf_path / "model.safetensors"))
    a = "phi3"
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), a)
    w.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(f"{a}.rope.dimension_count", int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    if longrope:
        w.add_tensor("rope_factors_long.weight", np.ones(6, np.float32))
    _write_tensors_and_close(w, weights, _phi3_gguf_name, linear_type)
    return out


def test_phi3_gguf_loads_and_matches_hf(phi3_pair, tmp_path):
    path, ours, ref = phi3_pair
    if "longrope" in path.name:  # LongRoPE factors as GGUF tensors are refused, with a clear line
        with pytest.raises(InputError, match="LongRoPE .* not supported in GGUF"):
            read_model_config(write_phi3_gguf(path, tmp_path / "lr.gguf", longrope=True))
        return
    gguf_path = write_phi3_gguf(path, tmp_path / "phi3.gguf")
    ckpt = load_checkpoint(gguf_path, show_progress=False)
    same = dict(rms_norm_eps=ours.config.rms_norm_eps, bos_token_id=ours.config.bos_token_id)
    assert dataclasses.replace(ckpt.config, **same) == ours.config
    for name, p in ours.state_dict().items():
        if name in ckpt.weights:
            assert torch.equal(ckpt.weights[name], p), name
    model = our_model(gguf_path)
    for n in (1, 17, 100):
        ids = prompt_ids(n, ours.config.vocab_size, 11 + n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        assert (paged_prefill_logits(model, ids) - expected).abs().max().item() < 1e-3, n


def test_phi3_gguf_q8_0_served_from_its_blocks(tmp_path):
    path = save_tiny_phi3(tmp_path / "hf", seed=7, partial_rotary_factor=0.75)
    gguf_path = write_phi3_gguf(path, tmp_path / "q8.gguf", T.Q8_0)
    native, _ = build_model(gguf_path, FP32, "gguf", show_progress=False)
    dequantized, _ = build_model(gguf_path, FP32, None, show_progress=False)
    ids = prompt_ids(20, native.config.vocab_size, 4)
    got, want = paged_prefill_logits(native, ids), paged_prefill_logits(dequantized, ids)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_phi3_int8_folder_round_trip_keeps_the_rotary(phi3_pair, tmp_path):
    # a quantized folder's config.json must carry partial_rotary_factor, and the reload rotate that many dims
    path, _, _ = phi3_pair
    model, config = build_model(path, FP32, "int8", show_progress=False)
    ids = prompt_ids(17, config.vocab_size, 8)
    got = paged_prefill_logits(model, ids)
    loaded, cfg = build_model(
        save_quantized(model, tmp_path / "q", source=path), FP32, None, show_progress=False
    )
    assert cfg.rotary_dim == config.rotary_dim and cfg.rope_scaling == config.rope_scaling
    assert torch.equal(paged_prefill_logits(loaded, ids), got)
