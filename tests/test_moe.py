"""Mixtures of experts (model/layers/moe.py): Mixtral, Qwen3-MoE and OLMoE against transformers (fp32), 8
experts with top-2 routing and each family's normalisation, Qwen3-MoE's dense layer among the sparse ones,
OLMoE's whole-projection q/k norms and clip_qkv; the batched-by-expert path against a per-token reference;
the checkpoints in transformers 5's fused 3-D layout and as GGUF files written the way convert_hf_to_gguf.py
writes them (llama.cpp's names, Mixtral as arch llama with permuted Q/K), dequantized and served from their
Q8_0 / Q4_0 / Q4_1 blocks; RTN at load and its folder; refusals (features no family implements, calibration,
OLMoE under tensor parallelism); the planner's parameter count; TP=2."""

from __future__ import annotations

import copy
import dataclasses
import json

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from model_helpers import paged_prefill_logits
from safetensors.torch import load_file, save_file
from test_loader_gguf import _hf_to_gguf_permute
from test_model_families import _folder, _gguf_name, _write_tensors_and_close, our_model
from test_model_vs_hf import (
    check_greedy_64,
    check_logits,
    check_prefill_logits,
    check_tensor_parallel_2_equals_1,
    hf_model,
    prompt_ids,
)
from tiny_models import save_tiny_mixtral, save_tiny_olmoe, save_tiny_qwen3_moe
from torch import nn

from pagedllm import LLM
from pagedllm.errors import InputError
from pagedllm.model import decode_stack
from pagedllm.model.build import build_model
from pagedllm.model.fuse import fuse_for_inference
from pagedllm.model.layers.moe import SparseMoeBlock, experts_forward, route
from pagedllm.model.loader import load_checkpoint, read_model_config
from pagedllm.model.quantized_checkpoint import save_quantized
from pagedllm.model.tensor_parallel import check_shardable
from pagedllm.planner.memory import param_count
from pagedllm.quantization.linear import QuantLinear

FP32 = torch.float32
SAVERS = {"mixtral": save_tiny_mixtral, "qwen3_moe": save_tiny_qwen3_moe, "olmoe": save_tiny_olmoe}


@pytest.fixture(scope="module", params=list(SAVERS))
def moe_pair(request, tmp_path_factory):
    path = SAVERS[request.param](tmp_path_factory.mktemp(request.param), seed=5)
    return path, our_model(path), hf_model(path)


def _first_moe_block(model) -> SparseMoeBlock:
    return next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))


def assert_close_on_average(got: torch.Tensor, want: torch.Tensor, rel: float = 0.05) -> None:
    """Quantized against float logits, on average: a token whose top-2 experts were nearly tied may take
    another expert once its router input moves by a rounding step, which moves that row far more."""
    assert (got - want).abs().mean().item() < rel * want.abs().mean().item()


# ---------------------------------------------------------------- the block itself


def test_experts_batched_by_expert_equal_a_per_token_reference():
    torch.manual_seed(0)
    d, f, n_exp = 16, 8, 6
    experts = nn.ModuleList(nn.Sequential(nn.Linear(d, f), nn.SiLU(), nn.Linear(f, d)) for _ in range(n_exp))
    for t, k in ((1, 2), (9, 2), (40, 3)):
        x = torch.randn(t, d)
        # experts 4 and 5 are never chosen: they must cost nothing and add nothing
        logits = torch.randn(t, n_exp)
        logits[:, 4:] = -30
        weights, ids = route(logits, k, renormalize=t != 9)
        assert not ((ids == 4) | (ids == 5)).any()
        want = torch.zeros(t, d)
        with torch.no_grad():
            for i in range(t):
                for j in range(k):
                    want[i] += weights[i, j] * experts[int(ids[i, j])](x[i : i + 1])[0]
            got = experts_forward(x, weights, ids, experts)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_route_normalisations():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs = logits.softmax(-1)
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(w, probs.gather(1, ids))  # OLMoE: the kept share as is
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))  # Mixtral, Qwen3-MoE: they sum to 1


# ---------------------------------------------------------------- against transformers


def test_moe_config_and_weights(moe_pair):
    path, ours, ref = moe_pair
    c = ours.config
    family = c.architecture
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert c.norm_topk_prob == (family != "olmoe")
    assert c.dense_layers == ([1] if family == "qwen3_moe" else [])
    assert c.qk_norm_full == (family == "olmoe") and c.clip_qkv == (1.5 if family == "olmoe" else None)
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer.mlp, SparseMoeBlock) == (i not in c.dense_layers)
    # every expert's weights are transformers' own (its fused [E, 2F, D] gate_up rows: gate then up)
    hf = ref.state_dict()
    mine = ours.state_dict()
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"]
    for j in (0, 7):
        expert = f"model.layers.0.mlp.experts.{j}."
        got = torch.cat([mine[expert + "gate_proj.weight"], mine[expert + "up_proj.weight"]])
        assert torch.equal(got, gate_up[j])
        assert torch.equal(mine[expert + "down_proj.weight"], hf["model.layers.0.mlp.experts.down_proj"][j])
    assert torch.equal(mine["model.layers.0.mlp.gate.weight"], hf["model.layers.0.mlp.gate.weight"])
    # the planner counts every expert and the router (it leaves out the q/k norms' few weights)
    qk_norms = ("q_norm.weight", "k_norm.weight")
    counted = sum(p.numel() for n, p in ref.named_parameters() if not n.endswith(qk_norms))
    assert param_count(c) == counted


def test_moe_logits_match_hf(moe_pair):
    check_logits(moe_pair, seed=7)  # 1, 15, 16, 17, 100 tokens, and chunked over a cached prefix


def test_moe_greedy_64_tokens_match_hf(moe_pair):
    path, ours, ref = moe_pair
    llm = check_greedy_64(path, ref, ours.config.vocab_size)
    # fuse.py merged each expert's gate and up into one matmul
    assert all(e.gate_up_proj is not None for e in _first_moe_block(llm.llm_engine.model).experts)


def test_fused_stack_refuses_moe(moe_pair):
    _, ours, _ = moe_pair
    fused = copy.deepcopy(ours)
    fuse_for_inference(fused)  # q/k/v merged as the stack wants them
    assert fused.decode_stack is None
    assert repr(fused.config.architecture) in decode_stack.unsupported_reason(fused)
    # even as a fused architecture, the router and experts (and the q/k norms) send it to the layer loop
    fused.config = dataclasses.replace(fused.config, architecture="llama")
    reason = decode_stack.unsupported_reason(fused)
    assert ("k_norm, q_norm" if fused.config.qk_norm else "experts, gate") in reason, reason
    for layer in fused.model.layers:  # without the norms: the MoE block itself
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert "layer 0 mlp has experts, gate" in decode_stack.unsupported_reason(fused)


def test_transformers5_fused_expert_layout_loads(moe_pair, tmp_path):
    """The 3-D experts.gate_up_proj / experts.down_proj that transformers 5 holds in memory, as a file."""
    path, ours, ref = moe_pair
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tied = {"lm_head.weight"} if ours.config.tie_word_embeddings else set()
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items() if k not in tied}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path, show_progress=False)
    mine = ours.state_dict()
    assert set(ckpt.weights) == set(mine) - tied
    for name, w in ckpt.weights.items():
        assert torch.equal(w, mine[name]), name


# ---------------------------------------------------------------- GGUF (llama.cpp's names and metadata)

_GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names -> the others'


def _stack_experts(weights: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict:
    """HF per-expert tensors -> one [experts, out, in] tensor per layer and part (convert_hf_to_gguf's
    stacking), named mlp.experts.{part}.weight, which the registry maps to ffn_{gate,up,down}_exps."""
    out = {}
    for name, w in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." not in name:
            out[name] = w
    for i in range(num_layers):
        for mixtral, part in _EXPERT_PARTS.items():
            p = f"model.layers.{i}"
            candidates = [
                (f"{p}.mlp.experts.{j}.{part}.weight", f"{p}.block_sparse_moe.experts.{j}.{mixtral}.weight")
                for j in range(num_experts)
            ]
            names = [n for pair in candidates for n in pair if n in weights]
            if names:
                out[f"{p}.mlp.experts.{part}.weight"] = torch.stack([weights[n] for n in names])
    return out


def write_moe_gguf(hf_path, out, linear_type=T.F32):
    """What convert_hf_to_gguf.py writes for Mixtral (arch llama, Q/K permuted), Qwen3-MoE and OLMoE."""
    cfg = json.loads((hf_path / "config.json").read_text())
    family = cfg["model_type"]
    arch = _GGUF_ARCH[family]
    n_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    ints = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"], "attention.key_length": head_dim,
            "attention.value_length": head_dim, "rope.dimension_count": head_dim,
            "expert_count": n_experts, "expert_used_count": cfg["num_experts_per_tok"]}  # fmt: skip
    if "moe_intermediate_size" in cfg:
        ints["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    weights = load_file(str(hf_path / "model.safetensors"))
    weights = _stack_experts(weights, cfg["num_hidden_layers"], n_experts)
    if arch == "llama":  # llama.cpp's llama arch rotates interleaved pairs: the converter permutes Q/K rows
        for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight"))]:
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            weights[name] = torch.from_numpy(_hf_to_gguf_permute(weights[name].numpy(), heads))
    if cfg.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    _write_tensors_and_close(w, weights, _gguf_name, linear_type)
    return out


@pytest.fixture(scope="module", params=list(SAVERS))
def gguf_pair(request, tmp_path_factory):
    """OLMoE without clip_qkv: a GGUF file has no key for it (llama.cpp runs OLMoE unclipped)."""
    folder = tmp_path_factory.mktemp(f"{request.param}-gguf")
    overrides = dict(clip_qkv=None) if request.param == "olmoe" else {}
    path = SAVERS[request.param](folder / "hf", seed=6, **overrides)
    return path, write_moe_gguf(path, folder / "model.gguf"), hf_model(path)


def test_moe_gguf_loads_and_matches_hf(gguf_pair):
    hf_path, gguf_path, ref = gguf_pair
    ckpt = load_checkpoint(gguf_path, show_progress=False)
    want = read_model_config(hf_path)
    same = dict(rms_norm_eps=want.rms_norm_eps, bos_token_id=want.bos_token_id)
    assert dataclasses.replace(ckpt.config, **same) == want  # Mixtral from arch llama + expert_count too
    hf_weights = load_checkpoint(hf_path, show_progress=False).weights
    assert set(ckpt.weights) == set(hf_weights)
    for name, w in hf_weights.items():
        assert torch.equal(ckpt.weights[name], w), name
    check_prefill_logits(our_model(gguf_path), ref)  # 1, 17 and 100 tokens


def test_moe_gguf_q8_0_experts_served_from_their_blocks(gguf_pair, tmp_path):
    check_served_from_blocks(write_moe_gguf(gguf_pair[0], tmp_path / "q8.gguf", T.Q8_0), T.Q8_0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_mixtral_gguf_q4_experts_served_from_their_blocks(tmp_path, qtype):
    hf_path = save_tiny_mixtral(tmp_path / "hf", seed=6)
    check_served_from_blocks(write_moe_gguf(hf_path, tmp_path / "q.gguf", qtype), qtype)


def check_served_from_blocks(path, qtype) -> None:
    """Every expert's linears from the file's blocks (its slice of the 3-D tensor, dequantizing exactly to
    what --quantization none loads), the router in float, and the logits close to the dequantized ones."""
    native, config = build_model(path, FP32, "gguf", show_progress=False)
    dequantized, _ = build_model(path, FP32, None, show_progress=False)
    mlp, float_mlp = _first_moe_block(native), _first_moe_block(dequantized)
    assert type(mlp.gate) is nn.Linear  # the router stays float, as llama.cpp keeps it
    for j in range(config.num_experts):  # each expert is its own slice of the 3-D tensors' blocks, exactly
        for part in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(mlp.experts[j], part)
            assert isinstance(linear, QuantLinear) and linear.bits == (8 if qtype == T.Q8_0 else 4)
            want = getattr(float_mlp.experts[j], part).weight
            assert torch.equal(linear.dequantize_weight(), want), (j, part)
    ids = prompt_ids(40, config.vocab_size, 4)
    assert_close_on_average(paged_prefill_logits(native, ids), paged_prefill_logits(dequantized, ids))


# ---------------------------------------------------------------- quantized at load, and its folder


def test_moe_int8_at_load_and_its_folder_round_trip(moe_pair, tmp_path):
    path, ours, _ = moe_pair
    model, config = build_model(path, FP32, "int8", show_progress=False)
    mlp = _first_moe_block(model)
    assert type(mlp.gate) is nn.Linear and all(isinstance(e.down_proj, QuantLinear) for e in mlp.experts)
    ids = prompt_ids(40, config.vocab_size, 8)
    got = paged_prefill_logits(model, ids)
    assert_close_on_average(got, paged_prefill_logits(ours, ids))
    folder = save_quantized(model, tmp_path / "q", source=path)
    loaded, cfg = build_model(folder, FP32, None, show_progress=False)
    assert cfg == config
    assert torch.equal(paged_prefill_logits(loaded, ids), got)


def test_moe_config_written_from_a_gguf_reads_back(gguf_pair, tmp_path):
    # a quantized folder of a GGUF writes its config.json from ModelConfig: every MoE field must survive
    from pagedllm.model.quantized_checkpoint import hf_config_dict

    _, gguf_path, _ = gguf_pair
    config = read_model_config(gguf_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert read_model_config(tmp_path) == config


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_quantization_of_experts_is_refused(moe_pair, method):
    import importlib

    _, ours, _ = moe_pair
    fn = getattr(importlib.import_module(f"pagedllm.quantization.{method}"), f"{method}_quantize_model")
    calib = [torch.tensor(prompt_ids(16, ours.config.vocab_size, 1))]
    with pytest.raises(InputError, match=f"{method.upper()} calibration of a mixture-of-experts model"):
        fn(ours, calib, bits=4, group_size=32, show_progress=False)


# ---------------------------------------------------------------- refusals

_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(_QWEN3_MOE, shared_expert_intermediate_size=64),
         r"shared_expert_intermediate_size=64 \(a shared expert\)"),
        (dict(_QWEN3_MOE, n_group=4), r"n_group=4 \(grouped top-k routing\)"),
        (dict(_QWEN3_MOE, topk_method="noaux_tc"), r"topk_method='noaux_tc'"),
        (dict(_QWEN3_MOE, num_experts_per_tok=9),
         "num_experts_per_tok must be a whole number between 1 and 8"),
        (dict(_QWEN3_MOE, use_sliding_window=True, sliding_window=64), "use_sliding_window=True"),
        (dict(_QWEN3_MOE, mlp_only_layers=[5]), "mlp_only_layers must list layer indices below 2"),
        (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8,
              num_experts_per_tok=2, mlp_only_layers=[1]),
         "mlp_only_layers=.* not supported for MixtralForCausalLM"),
        (dict(architectures=["LlamaForCausalLM"], clip_qkv=8.0), r"clip_qkv=8.0 \(clipped q/k/v\)"),
        (dict(architectures=["LlamaForCausalLM"], num_local_experts=8),
         "num_local_experts=8 .* LlamaForCausalLM"),
        (dict(architectures=["Qwen2MoeForCausalLM"]), "unsupported architecture 'Qwen2MoeForCausalLM'"),
    ],
)  # fmt: skip
def test_moe_features_not_implemented_are_refused(tmp_path, overrides, message):
    with pytest.raises(InputError, match=message):
        read_model_config(_folder(tmp_path, **overrides))


def test_moe_config_folder_reads(tmp_path):
    c = read_model_config(_folder(tmp_path, **_QWEN3_MOE, decoder_sparse_step=2, norm_topk_prob=True))
    assert c.architecture == "qwen3_moe" and c.dense_layers == [0] and c.norm_topk_prob  # layer 1 sparse


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("expert_shared_count", 2, r"qwen3moe.expert_shared_count=2 \(shared experts\)"),
        ("expert_group_count", 4, "grouped top-k routing"),
        ("expert_gating_func", 2, r"expert_gating_func=2 \(a router other than softmax\)"),
    ],
)
def test_moe_gguf_features_not_implemented_are_refused(tmp_path, key, value, message):
    path = tmp_path / "bad.gguf"  # metadata only: it is read (and refused) before any tensor
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    meta = {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 96,
            "vocab_size": 100, "expert_count": 8, "expert_used_count": 2, key: value}  # fmt: skip
    for name, v in meta.items():
        w.add_uint32(f"qwen3moe.{name}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match=message):
        read_model_config(path)


def test_tensor_parallel_refuses_olmoe_only(moe_pair):
    path, ours, _ = moe_pair
    if ours.config.architecture != "olmoe":
        check_shardable(ours.config, 2)  # Mixtral and Qwen3-MoE split (test_moe_tensor_parallel_2_equals_1)
        return
    with pytest.raises(InputError, match="q/k norm over the whole projection .* tensor parallelism"):
        LLM(model=str(path), dtype="fp32", tensor_parallel_size=2, show_progress=False)


@pytest.mark.slow
def test_moe_tensor_parallel_2_equals_1(tmp_path):
    # Qwen3-MoE: sparse and dense layers, each expert cut in two by its intermediate size
    path = save_tiny_qwen3_moe(tmp_path / "m", seed=8)
    check_tensor_parallel_2_equals_1(path, read_model_config(path).vocab_size)
