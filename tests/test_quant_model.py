"""Quantized models end to end: GGUF served natively vs dequantized, RTN wiring, save/load round trips."""

import pytest
import torch
from model_helpers import paged_prefill_logits
from tiny_models import save_tiny_llama, save_tiny_qwen2

from pagedllm import LLM, SamplingParams, ops
from pagedllm.errors import InputError
from pagedllm.model.build import build_model
from pagedllm.model.loader import default_model_path, load_checkpoint
from pagedllm.model.quantized_checkpoint import save_quantized
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.quantization import woq_kernels
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.model import resident_weight_bytes
from pagedllm.quantization.rtn import rtn_quantize_weight
from pagedllm.quantization.uniform import dequantize

BF16 = torch.bfloat16


def quant_layers(model) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(paged_prefill_logits(model, ids)[-1].argmax()))
    return ids[-n:]


# ---- the default model: GGUF Q4_1 blocks served natively -----------------------------------------------
@pytest.fixture(scope="module")
def default_prompt() -> list[int]:
    return Tokenizer.from_checkpoint(default_model_path()).encode("The capital of France is")


@pytest.fixture(scope="module")
def gguf_dequantized():
    return build_model(default_model_path(), BF16, None, show_progress=False)[0]


@pytest.fixture(scope="module")
def gguf_native():
    return build_model(default_model_path(), BF16, "gguf", show_progress=False)[0]


def test_gguf_native_serves_every_decoder_linear_from_int4_blocks(gguf_native, gguf_dequantized):
    cfg = gguf_native.config
    layers = [m for m in quant_layers(gguf_native) if m.name not in ("lm_head", "model.embed_tokens")]
    assert len(layers) == 7 * cfg.num_layers
    assert all(m.bits == 4 and m.group_size == 32 for m in layers)
    backend = ops.backend("quantized_linear")  # amx, avx2, or torch's kernels ("torch-packed")
    assert backend in ("amx", "avx2", "torch-packed")
    # every one packed at load for bf16 activations on the backend's own kernel (Q4_1 is torch's INT4 one's too)
    assert all(m.kernel is not None and m.kernel.name == backend and m.layout for m in layers)
    # the AMX and AVX2 layouts hold the blocks themselves: the stored copy is released
    assert all((m.qweight is None) == (backend != "torch-packed") for m in layers)
    head = gguf_native.lm_head
    if backend == "torch-packed":  # tied to the (Q8_0, dequantized) embedding: no torch kernel takes Q8_0
        assert isinstance(head, torch.nn.Linear)
    else:  # the Q8_0 token_embd blocks themselves, which the kernel multiplies with
        assert isinstance(head, QuantLinear) and (head.bits, head.group_size) == (8, 32)
        assert head.kernel is not None and head.kernel.name == backend
        embedding = gguf_native.model.embed_tokens.weight  # the small table's float copy of the same blocks
        assert torch.equal(head.dequantize_weight(embedding.dtype), embedding)
    # per decoder weight: 0.5 B codes + 0.125 B fp16 scales/mins in the AMX layout (without AMX: the stored
    # form with fp32 scales/mins and torch's INT4 layout, 0.75 B more), where bf16 holds 2 B; the embedding
    # stays bf16 in both (and the Q8_0 lm_head adds 1.125 B a weight here, where the engine's bf16 model
    # adds its 2 B prepacked lm_head copy). Measured with AMX: 147.7 MiB against 256.6.
    ratio = 0.6 if backend != "torch-packed" else 0.9
    assert resident_weight_bytes(gguf_native) < ratio * resident_weight_bytes(gguf_dequantized)


def test_gguf_native_layer_equals_dequantized_weights(gguf_native):
    """In float32 the stored blocks give exactly the loader's dequantized (and unpermuted) weights."""
    ckpt = load_checkpoint(default_model_path(), show_progress=False)
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.5.mlp.down_proj",
    ):
        layer = gguf_native.get_submodule(name)
        assert torch.equal(layer.dequantize_weight(torch.float32), ckpt.weights[name + ".weight"])


def test_gguf_native_logits_close_to_dequantized(gguf_native, gguf_dequantized, default_prompt):
    native = paged_prefill_logits(gguf_native, default_prompt)
    ref = paged_prefill_logits(gguf_dequantized, default_prompt)
    diff = (native - ref).abs()
    # Both are bf16 models of the same weights. AMX tiles: the kernel's bf16 block scales differ from
    # bf16-rounded weights by bf16 ulps; measured max 0.63, mean 0.15 on logits of magnitude ~20. The int8
    # kernels (AVX2 at every row count; at the amx tier the gemv, which a prompt of at most GEMV_MAX_ROWS
    # tokens runs): activations also rounded to int8 per 32 inputs (as llama.cpp's Q8 activations); measured
    # max 1.67, mean 0.52 (AVX2), 1.63, 0.53 (amx gemv).
    backend = ops.backend("quantized_linear")
    int8 = backend == "avx2" or (backend == "amx" and len(default_prompt) <= woq_kernels.GEMV_MAX_ROWS)
    bound = (2.5, 0.8) if int8 else (1.5, 0.3)
    assert diff.max() < bound[0] and diff.mean() < bound[1], (diff.max(), diff.mean())
    assert torch.equal(native.argmax(-1), ref.argmax(-1))


def test_gguf_native_greedy_16_tokens_equal(gguf_native, gguf_dequantized, default_prompt):
    assert greedy(gguf_native, default_prompt, 16) == greedy(gguf_dequantized, default_prompt, 16)


# ---- RTN at load on tiny models ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2")


def fake_quantized(path, quantization: str, dtype=BF16):
    """The float model with each decoder linear's weight replaced by dequantize(RTN(weight))."""
    bits, group = {"int8": (8, None), "int4": (4, 32), "int4-g64": (4, 64)}[quantization]
    model, _ = build_model(path, dtype, None, show_progress=False)
    ckpt = load_checkpoint(path, show_progress=False)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
                m.weight.copy_(dequantize(rtn_quantize_weight(ckpt.weights[name + ".weight"], bits, group)))
    return model


@pytest.mark.parametrize(
    "which,quantization",
    [("llama", "int8"), ("llama", "int4"), ("llama", "int4-g64"), ("qwen2", "int8"), ("qwen2", "int4")],
)
def test_rtn_model_equals_fake_quantized_float_model(quantization, which, tiny_llama, tiny_qwen2):
    path = tiny_llama if which == "llama" else tiny_qwen2
    ids = list(range(3, 40))
    model, _ = build_model(path, BF16, quantization, show_progress=False)
    assert len(quant_layers(model)) == 7 * model.config.num_layers
    got = paged_prefill_logits(model, ids)
    ref = paged_prefill_logits(fake_quantized(path, quantization), ids)
    exact = paged_prefill_logits(fake_quantized(path, quantization, torch.float32), ids)
    # as close to the fp32 computation as the plain bf16 model of the same weights, within 2x
    assert (got - exact).abs().mean() <= 2 * (ref - exact).abs().mean() + 1e-3
    # fp32 activations on the reference backend (the dequantize path): the same function up to float32
    # rounding; on the AVX2 kernel, within its int8-activation bound (tests/test_woq_avx2.py)
    with ops.forced(quantized_linear="torch"):
        model32 = build_model(path, torch.float32, quantization, show_progress=False)[0]
        got32 = paged_prefill_logits(model32, ids)
    assert all(m.kernel is None for m in quant_layers(model32))  # the reference ran
    torch.testing.assert_close(got32, exact, rtol=1e-4, atol=1e-4)
    model32 = build_model(path, torch.float32, quantization, show_progress=False)[0]
    kernel32 = paged_prefill_logits(model32, ids)
    # fp32 activations: the AVX2 kernel where the table has it (amx or avx2), else the reference
    fp32_kernel = "avx2" if ops.backend("quantized_linear") in ("amx", "avx2") else None
    assert all((m.kernel and m.kernel.name) == fp32_kernel for m in quant_layers(model32))
    assert ((kernel32 - exact).norm() / exact.norm()).item() < 3e-2


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_quantized_folder_round_trip_gives_identical_logits(
    quantization, dtype, tiny_llama, tiny_qwen2, tmp_path
):
    for i, path in enumerate((tiny_llama, tiny_qwen2)):
        model, _ = build_model(path, dtype, quantization, show_progress=False)
        out = save_quantized(model, tmp_path / f"q{i}", source=path, method="rtn")
        loaded, cfg = build_model(out, dtype, None, show_progress=False)
        assert cfg == model.config
        assert len(quant_layers(loaded)) == len(quant_layers(model))
        ids = list(range(5, 30))
        assert torch.equal(paged_prefill_logits(loaded, ids), paged_prefill_logits(model, ids))
        assert resident_weight_bytes(loaded) == resident_weight_bytes(model)


def test_gguf_native_layers_cannot_be_saved(gguf_native, tmp_path):
    with pytest.raises(InputError, match="not whole numbers|mix bits"):
        save_quantized(gguf_native, tmp_path / "x", source=default_model_path())


def test_bad_quantization_raises_input_error(tiny_llama, tmp_path):
    with pytest.raises(InputError, match="int8, int4, int4-g32, int4-g64, int4-g128, gguf") as e:
        build_model(tiny_llama, BF16, "int3", show_progress=False)
    assert e.value.param == "quantization"
    with pytest.raises(InputError, match="needs a GGUF file"):
        build_model(tiny_llama, BF16, "gguf", show_progress=False)
    with pytest.raises(InputError, match="group_size 128 does not divide in_features 64"):
        build_model(tiny_llama, BF16, "int4-g128", show_progress=False)
    model, _ = build_model(tiny_llama, BF16, "int8", show_progress=False)
    out = save_quantized(model, tmp_path / "q", source=tiny_llama)
    with pytest.raises(InputError, match="already quantized"):
        build_model(out, BF16, "int4", show_progress=False)


# ---- the offline API ------------------------------------------------------------------------------------
def test_llm_int8_generates_like_bf16():
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = {}
    for q in (None, "int8"):
        llm = LLM(model="default", quantization=q, kv_cache_memory="32MiB", show_progress=False)
        outs[q] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for ref, got in zip(outs[None], outs["int8"]):
        assert got.text.strip() and len(got.token_ids) == 8
        # INT8 per channel keeps this model's greedy continuation (measured: all 16 of 16 tokens for both
        # prompts; INT4 RTN does not: it already changes the first or seventh token)
        assert got.token_ids == ref.token_ids, (ref.text, got.text)
