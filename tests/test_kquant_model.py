"""A K-quant model (Q4_K_M's mix: Q4_K q / k / gate / up / o, Q6_K v in one layer, Q6_K down and a Q6_K tied
token_embd) served from its blocks: its logits within the stated bound of the same file dequantized, with
the fused decode stack taking the layer whose q / k / v cannot merge, and the embedding looked up from the
lm_head's blocks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from model_helpers import paged_prefill_logits
from test_gguf_blocks import random_blocks
from test_loader_gguf import _llama_meta, _write_gguf

from pagedllm import ops
from pagedllm.model.build import load_model_for_inference
from pagedllm.quantization import gguf_native
from pagedllm.quantization.embedding import QuantEmbedding
from pagedllm.quantization.linear import QuantLinear

D, FFN, HEADS, KV, VOCAB, LAYERS = 256, 512, 4, 2, 320, 2


def k_blocks(rows: int, cols: int, qtype: T, seed: int) -> np.ndarray:
    """Random valid blocks (every code, sub-block scale and min occurs), their fp16 super-scales small
    enough that weights are ~0.02 like a trained model's: activations stay in a trained model's range."""
    raw = random_blocks(qtype.name, rows, cols, seed).reshape(rows, -1, 210 if qtype == T.Q6_K else 144)
    d = np.full(raw.shape[:2] + (1,), 1e-5 if qtype == T.Q6_K else 1e-4, np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        raw[..., -2:] = d
    else:
        raw[..., 0:2], raw[..., 2:4] = d, (np.full(raw.shape[:2] + (1,), 1e-4, np.float16).view(np.uint8))
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def kquant_path(tmp_path_factory):
    hd = D // HEADS
    shapes = {"attn_q": (HEADS * hd, D), "attn_k": (KV * hd, D), "attn_v": (KV * hd, D),
              "attn_output": (D, HEADS * hd), "ffn_gate": (FFN, D), "ffn_up": (FFN, D), "ffn_down": (D, FFN)}  # fmt: skip
    tensors = {
        "token_embd.weight": (k_blocks(VOCAB, D, T.Q6_K, 1), T.Q6_K, True),
        "output_norm.weight": (np.ones(D, np.float32), T.F32),
    }
    for i in range(LAYERS):
        for name, shape in shapes.items():
            q6 = name == "ffn_down" or (name == "attn_v" and i == 0)  # Q4_K_M's use_more_bits layers
            qtype = T.Q6_K if q6 else T.Q4_K
            seed = 10 * i + len(tensors)
            tensors[f"blk.{i}.{name}.weight"] = (k_blocks(*shape, qtype, seed), qtype, True)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (np.ones(D, np.float32), T.F32)
    meta = _llama_meta("llama", LAYERS, D, HEADS, KV, FFN)
    meta["llama.vocab_size"] = VOCAB
    return _write_gguf(tmp_path_factory.mktemp("kq") / "kquant.gguf", "llama", meta, tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_model_logits_within_bound_of_the_dequantized_model(kquant_path, dtype, monkeypatch):
    monkeypatch.setattr(
        gguf_native, "EMBEDDING_FLOAT_MAX_BYTES", 0
    )  # the lookup from blocks, even this small
    native, _ = load_model_for_inference(kquant_path, dtype, "gguf", show_progress=False)
    ref, _ = load_model_for_inference(kquant_path, torch.float32, None, show_progress=False)
    layer0 = native.model.layers[0].self_attn
    assert layer0.qkv_proj is None  # Q6_K v beside Q4_K q / k: three calls
    assert native.model.layers[1].self_attn.qkv_proj is not None
    if ops.kernel("quantized_linear", "woq_avx2") is not None and ops.backend("quantized_linear") == "avx2":
        assert (
            isinstance(native.model.embed_tokens, QuantEmbedding)
            and native.model.embed_tokens.table is native.lm_head
        )
        assert native.decode_stack is not None  # the stack takes the unmerged layer
        assert all(m.layout[1].dtype == torch.uint8 for m in native.modules() if isinstance(m, QuantLinear))
    ids = list(range(3, 60))
    got = paged_prefill_logits(native, ids).float()
    want = paged_prefill_logits(ref, ids).float()
    # the AVX2 kernel's contract is a relative error under 1.5e-2 a linear (int8 activations per 32 inputs);
    # through 2 layers and the lm_head, measured 3.3e-3 in float32 (weights ~0.02, as a trained model's)
    bound = 1.5e-2 if dtype == torch.float32 else 3e-2  # bf16: its rounding of every activation on top
    err = ((got - want).norm() / want.norm()).item()
    assert err < bound, err
