"""The inference layout (model/fuse.py): merged q/k/v and gate/up, prepacked bf16 weights.

It must compute what the checkpoint layout computes, for float and quantized layers, and report the
same resident bytes.
"""

import pytest
import torch
from model_helpers import paged_prefill_logits
from tiny_models import save_tiny_qwen2

from pagedllm import ops, platform
from pagedllm.model.build import build_model
from pagedllm.model.fuse import fuse_for_inference
from pagedllm.model.layers.packed_linear import PackedLinear, prepacking_available
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.model import resident_weight_bytes
from pagedllm.quantization.rtn import rtn_quantize_weight


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    # 3 heads over 1 KV head, q/k/v bias, tied embeddings
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_prepacked_linear_is_chosen_where_bf16_is_native():
    if not platform.capabilities().native_bf16:
        pytest.skip(f"tier {platform.capabilities().tier}: no native bf16, so bf16 linears stay on ATen's gemm")
    assert prepacking_available(), "oneDNN prepacked linear missing: bf16 decode loses its fast path"
    assert ops.backend("linear") == "onednn-prepacked"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_gives_the_same_logits(qwen2_path, dtype):
    model, _ = build_model(qwen2_path, dtype)
    ids = list(range(3, 60))
    want = paged_prefill_logits(model, ids, chunk=20)
    before = resident_weight_bytes(model)
    fuse_for_inference(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
    assert attn.qkv_proj.out_features == 3 * 32 + 2 * 32
    prepacked = dtype == torch.bfloat16 and ops.backend("linear") == "onednn-prepacked"
    if prepacked:
        assert isinstance(attn.qkv_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)
    else:
        assert not isinstance(attn.qkv_proj, PackedLinear)
    got = paged_prefill_logits(model, ids, chunk=20)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16: the tied lm_head gets its own packed copy of the embedding, and says so
    lm_head_copy = model.model.embed_tokens.weight.nbytes if prepacked else 0
    assert resident_weight_bytes(model) == before + lm_head_copy
    fuse_for_inference(model)  # idempotent
    torch.testing.assert_close(paged_prefill_logits(model, ids, chunk=20), got, rtol=0, atol=0)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, None)])
@pytest.mark.parametrize("rows", [1, 200])  # the packed kernel, then the dequantize path
def test_concatenated_quant_linears_equal_the_parts(bits, group_size, rows):
    gen = torch.Generator().manual_seed(bits)
    parts = []
    for out_features, bias in ((64, True), (32, False), (32, True)):
        w = torch.randn(out_features, 96, generator=gen)
        b = torch.randn(out_features, generator=gen) if bias else None
        parts.append(QuantLinear.from_quantized(rtn_quantize_weight(w, bits, group_size), b))
    merged = QuantLinear.concat(parts)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    want = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(merged(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot concatenate"):
        QuantLinear.concat(
            [parts[0], QuantLinear.from_quantized(rtn_quantize_weight(torch.randn(8, 96), 4, 96))]
        )
