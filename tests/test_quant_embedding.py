"""The token embedding looked up from quantized rows (quantization/embedding.py): only a step's rows are
dequantized, and they are exactly the rows the float embedding held; a tied table is the lm_head itself."""

import numpy as np
import pytest
import torch
from test_gguf_blocks import random_blocks

from pagedllm import ops
from pagedllm.config import ModelConfig
from pagedllm.model.build import load_model_for_inference
from pagedllm.model.loader import default_model_path
from pagedllm.quantization.embedding import QuantEmbedding
from pagedllm.quantization.gguf_native import gguf_quant_linear, packed_gguf_linear
from pagedllm.quantization.linear import QuantLinear

CFG = ModelConfig(
    vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
    head_dim=64, architecture="llama",
)  # fmt: skip


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("packed", [False, True])
def test_rows_are_the_dequantized_weight_rows(type_name, packed):
    raw = random_blocks(type_name, 300, 256, seed=3)  # 300 rows: a last panel of 4
    layer = gguf_quant_linear("model.embed_tokens", type_name, raw, (300, 256), CFG)
    with ops.forced(quantized_linear="torch"):
        want = layer.dequantize_weight(torch.float32)
    if packed:
        layer.pack(torch.bfloat16)
    ids = torch.tensor([0, 299, 7, 7, 8, 150, 296])
    got = layer.rows(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want[ids])
    embed = QuantEmbedding(layer, torch.bfloat16)
    out = embed(ids.view(1, -1))
    assert out.shape == (1, 7, 256) and torch.equal(out[0], want[ids].bfloat16())
    with pytest.raises(IndexError):
        embed(torch.tensor([300]))


@pytest.mark.skipif(
    ops.kernel("quantized_linear", "woq_avx2") is None, reason="no AVX2 kernel on this machine"
)
@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_0"])
@pytest.mark.parametrize("rows", [300, 320])
def test_a_big_weight_built_slice_by_slice_is_the_whole_one(type_name, rows, monkeypatch):
    """packed_gguf_linear builds a big weight in row slices (no full-size transient): the same layout, on
    the kernel the whole weight takes (at the amx tier 320 Q4_0 rows stack AMX slices; 300 rows, not a
    whole number of its 16-row tiles, take the AVX2 kernel, which the last slice alone would not)."""
    import pagedllm.quantization.gguf_native as native

    raw = random_blocks(type_name, rows, 256, seed=5)
    whole = gguf_quant_linear("model.layers.0.mlp.down_proj", type_name, raw, (rows, 256), CFG)
    whole.pack(torch.bfloat16)
    monkeypatch.setattr(native, "SLICE_WEIGHTS", 64 * 256)  # slices of 64 rows
    sliced = packed_gguf_linear(
        "model.layers.0.mlp.down_proj", type_name, raw, (rows, 256), CFG, torch.bfloat16
    )
    assert sliced.kernel is whole.kernel and sliced.qweight is None
    amx_takes = ops.backend("quantized_linear") == "amx" and type_name == "Q4_0" and rows % 16 == 0
    assert sliced.kernel.name == ("amx" if amx_takes else "avx2")
    for a, b in zip(sliced.layout, whole.layout):
        assert torch.equal(a, b)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(sliced(x), whole(x))


@pytest.mark.parametrize("from_blocks", [True, False])
def test_the_default_gguf_model_looks_its_embedding_up_from_the_lm_head_blocks(from_blocks, monkeypatch):
    """The default model ties its embeddings (a Q8_0 token_embd). A table whose float copy is big is looked
    up from its blocks, the lookup and the lm_head sharing one QuantLinear where its kernel indexes rows; a
    small one (the default model's 54 MiB, under EMBEDDING_FLOAT_MAX_BYTES) is a float embedding: both give
    the same rows."""
    import pagedllm.quantization.gguf_native as native

    monkeypatch.setattr(
        native, "EMBEDDING_FLOAT_MAX_BYTES", 0 if from_blocks else native.EMBEDDING_FLOAT_MAX_BYTES
    )
    model, _ = load_model_for_inference(default_model_path(), torch.bfloat16, "gguf", show_progress=False)
    embed = model.model.embed_tokens
    assert model.dtype == torch.bfloat16
    if not from_blocks:
        assert isinstance(embed, torch.nn.Embedding)
        ids = torch.tensor([[1, 2, 3, 49151]])
        if isinstance(model.lm_head, QuantLinear):  # the tied blocks themselves (no kernel here: a float head)
            assert torch.equal(model.embed(ids)[0], model.lm_head.rows(ids[0]).bfloat16())
        return
    assert isinstance(embed, QuantEmbedding)
    if isinstance(model.lm_head, QuantLinear) and model.lm_head.gives_rows_cheaply():
        assert embed.table is model.lm_head  # one copy of the blocks
    ids = torch.tensor([[1, 2, 3, 49151]])
    with ops.forced(quantized_linear="torch"):
        want = embed.table.dequantize_weight(torch.float32)[ids[0]].bfloat16()
    assert torch.equal(model.embed(ids)[0], want)
    assert np.isfinite(want.float().numpy()).all()
