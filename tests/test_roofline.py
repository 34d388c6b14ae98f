"""The single-stream decode roofline (pagedllm/bench/roofline.py): bytes read per token, of a GGUF file and of
a built model, and the percentage of the bandwidth roofline. Every expected figure is counted by hand from
the shapes and ggml's block sizes, so a wrong sum, a dropped or doubly counted tensor fails."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from torch import nn

from pagedllm.bench import roofline
from pagedllm.config import ModelConfig
from pagedllm.model.layers.moe import SparseMoeBlock
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.quantization.linear import QuantLinear

# a tiny llama in GGUF: vocab 64, hidden 32. Q8_0 is 34 bytes a block of 32 (an f16 scale, 32 int8)
VOCAB, D = 64, 32
EMBD_F32 = VOCAB * D * 4  # token_embd.weight, F32: 8192
OUTPUT_Q8 = VOCAB * 34  # output.weight, Q8_0, one block a row: 2176
ATTN_Q_Q8 = D * 34  # blk.0.attn_q.weight, Q8_0: 1088
NORM_F32 = D * 4  # blk.0.attn_norm.weight and output_norm.weight, F32: 128 each


def write_tiny_gguf(path: Path, tied: bool = False, experts: tuple[int, int] | None = None) -> Path:
    """A GGUF file with the tensors a decode step reads (no model runs it); tied: no output.weight.
    experts (count, used): also a blk.0.ffn_up_exps.weight F32 [count, 16, D] and the two metadata keys."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if experts:
        w.add_uint32("llama.expert_count", experts[0])
        w.add_uint32("llama.expert_used_count", experts[1])
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, D), dtype=np.float32))
    if not tied:
        q8 = quantize(rng.standard_normal((VOCAB, D), dtype=np.float32), T.Q8_0)
        w.add_tensor("output.weight", q8, raw_dtype=T.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(D, dtype=np.float32))
    q8 = quantize(rng.standard_normal((D, D), dtype=np.float32), T.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=T.Q8_0)
    if experts:
        w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((experts[0], 16, D), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- GGUF files -------------------------------------------------------------------------------------------
def test_gguf_with_output_weight_excludes_the_token_embedding(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "untied.gguf")
    assert roofline.gguf_bytes_per_token(path) == OUTPUT_Q8 + ATTN_Q_Q8 + 2 * NORM_F32 == 3520


def test_gguf_without_output_weight_counts_the_tied_embedding_once(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    assert roofline.gguf_bytes_per_token(path) == EMBD_F32 + ATTN_Q_Q8 + 2 * NORM_F32 == 9536


def test_gguf_experts_count_with_the_share_a_token_is_routed_to(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "moe.gguf", experts=(4, 2))
    experts_f32 = 4 * 16 * D * 4  # 8192 in the file, half of it read per token
    assert roofline.gguf_bytes_per_token(path) == 3520 + experts_f32 // 2 == 7616


def test_gguf_decode_bytes_of_tensor_sizes() -> None:
    sizes = {
        "token_embd.weight": 1000,
        "output.weight": 300,
        "blk.0.attn_q.weight": 50,
        "output_norm.weight": 4,
    }
    assert roofline.gguf_decode_bytes(sizes) == 354
    del sizes["output.weight"]
    assert roofline.gguf_decode_bytes(sizes) == 1054
    # experts at the share routed to; a shared expert (_shexp) is read whole
    sizes |= {"blk.0.ffn_gate_exps.weight": 800, "blk.0.ffn_gate_shexp.weight": 80}
    assert roofline.gguf_decode_bytes(sizes, active_expert_fraction=0.25) == 1054 + 200 + 80


# ---- a built model ------------------------------------------------------------------------------------------
def _tiny_config(**kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        **kw,
    )


# float32, per layer: q 32x32, k and v 16x32, o 32x32, gate and up 64x32, down 32x64 (9216 weights) and
# two norms of 32; then the final norm and the lm_head 64x32. The embedding (64x32) is not read.
LAYER_F32 = (1024 + 512 + 512 + 1024 + 3 * 2048) * 4 + 2 * D * 4  # 37120
MODEL_F32 = 2 * LAYER_F32 + D * 4 + VOCAB * D * 4  # 82560


@pytest.mark.parametrize("tied", [False, True])
def test_model_bytes_per_token_counts_linears_norms_and_the_lm_head_not_the_embedding(tied: bool) -> None:
    # tied: the lm_head multiplies by the embedding's matrix, which is then read once, as the lm_head
    model = LlamaForCausalLM(_tiny_config(tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert roofline.model_bytes_per_token(model) == MODEL_F32 == 82560
    assert roofline.model_bytes_per_token(model.to(torch.bfloat16)) == MODEL_F32 // 2


def test_model_bytes_per_token_takes_a_quantized_linear_as_stored() -> None:
    model = LlamaForCausalLM(_tiny_config())
    attn = model.model.layers[0].self_attn
    codes = torch.randint(0, 16, (D, D), dtype=torch.uint8)
    attn.q_proj = QuantLinear.from_codes(codes, torch.ones(D, 1), torch.zeros(D, 1), bits=4, group_size=32)
    # 4-bit codes of 32x32 (512 bytes) and a float32 scale and min a row (128 + 128) instead of 4096 bytes
    assert attn.q_proj.weight_bytes() == 768
    assert roofline.model_bytes_per_token(model) == MODEL_F32 - 1024 * 4 + 768


def test_model_bytes_per_token_reads_the_routed_share_of_the_experts() -> None:
    cfg = _tiny_config(num_experts=4, num_experts_per_tok=2)
    block = SparseMoeBlock(cfg, lambda: nn.Linear(D, 16, bias=False))  # 2048 bytes an expert
    # the router (4x32 float32) every token, 2 of the 4 experts
    assert roofline.model_bytes_per_token(block) == 4 * D * 4 + 2 * 2048 == 4608


# ---- the roofline ------------------------------------------------------------------------------------------
def test_roofline_and_percentage() -> None:
    assert roofline.roofline_tokens_per_second(20.0, 500_000_000) == pytest.approx(40.0)
    assert roofline.percent_of_roofline(30.0, 20.0, 500_000_000) == pytest.approx(75.0)
    row = {"decode_tokens_per_second": 30.0, "bytes_per_token": 500_000_000}
    assert roofline.roofline_figures(row, 20.0) == {
        "bytes_per_token": 500_000_000,
        "roofline_tokens_per_second": pytest.approx(40.0),
        "percent_of_roofline": pytest.approx(75.0),
    }
    assert roofline.roofline_figures(row, None) == {}  # no bandwidth measured: no roofline
    assert roofline.roofline_figures({"decode_tokens_per_second": 30.0}, 20.0) == {}


def test_format_roofline_prints_the_bandwidth_once_and_each_system() -> None:
    one = {"num_requests": 1}
    report = {
        "pagedllm": one
        | {"decode_tokens_per_second": 30.0, "bytes_per_token": 500_000_000, "load_time_s": 4.31},
        "llama.cpp": one
        | {"decode_tokens_per_second": 12.0, "bytes_per_token": 250_000_000, "load_time_s": 0.5},
        "ratio_vs_llama.cpp": 3.0,
    }
    lines = roofline.format_roofline(report, 20.0, threads=2).splitlines()
    assert lines[0] == "memory read bandwidth: 20.0 GB/s (2 threads, torch.sum over 512 MB)"
    assert lines[1].split(": ", 1) == [
        "        pagedllm",
        "load 4.3 s, 500.0 MB read per token, roofline 40.0 tok/s, decode at 75% of it",
    ]
    assert lines[2].endswith("load 0.5 s, 250.0 MB read per token, roofline 80.0 tok/s, decode at 15% of it")
    assert len(lines) == 3
    # a batch reads each weight once for many tokens: no single-stream roofline for it
    report["pagedllm"]["num_requests"] = 32
    assert (
        roofline.format_roofline(report, 20.0, 2)
        .splitlines()[1]
        .endswith("load 4.3 s, 500.0 MB read per token")
    )
