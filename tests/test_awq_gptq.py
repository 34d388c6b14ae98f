"""AWQ and GPTQ: same storage format as round-to-nearest, and lower output error than it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_llama

from pagedllm.errors import InputError
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint, resolve_model_path
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.quantization.awq import awq_quantize_layer, awq_quantize_model
from pagedllm.quantization.calib import float_rotary, layer0_inputs, load_calibration, run_layer
from pagedllm.quantization.gptq import gptq_quantize_model, gptq_quantize_weight
from pagedllm.quantization.uniform import dequantize, fake_quantize, quantize

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def correlated_problem(seed: int = 0, out_f: int = 48, in_f: int = 128, tokens: int = 2048):
    """A weight and inputs whose channels are correlated and unevenly scaled (where GPTQ has work to do)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    mix = torch.eye(in_f) + torch.randn(in_f, in_f, generator=g) / in_f**0.5
    x = (torch.randn(tokens, in_f, generator=g) @ mix) * torch.linspace(0.2, 3, in_f)
    return w, x


def out_err(x, w, w_hat) -> float:
    return (x @ (w_hat - w).T).norm().item()


def test_gptq_without_correlation_is_exactly_rtn():
    """H = I spreads no error: the codes, scales and zeros must be RTN's, bit for bit (same format)."""
    w, _ = correlated_problem()
    for g in (32, None):
        qt = gptq_quantize_weight(w, torch.eye(w.shape[1]), bits=4, group_size=g, damp=0.0)
        ref = quantize(w, 4, axis=-1, group_size=g) if g else quantize(w, 4, axis=0)
        assert torch.equal(qt.codes, ref.codes) and qt.codes.dtype == torch.uint8
        assert torch.equal(qt.scale, ref.scale) and torch.equal(qt.zero_point, ref.zero_point)
        assert (qt.axis, qt.group_size) == (ref.axis, ref.group_size)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, None])
def test_gptq_beats_rtn_on_a_correlated_problem(act_order, group_size):
    w, x = correlated_problem()
    h = 2 * x.T @ x / x.shape[0]
    qt = gptq_quantize_weight(w, h, bits=3, group_size=group_size, act_order=act_order, block_size=64)
    assert qt.codes.max() <= 7
    rtn = fake_quantize(w, 3, axis=-1, group_size=group_size) if group_size else fake_quantize(w, 3, axis=0)
    assert out_err(x, w, dequantize(qt)) < 0.95 * out_err(x, w, rtn)


def test_gptq_dead_input_columns():
    w, x = correlated_problem()
    x[:, 5] = 0  # an input that never fires: H has a zero row/column
    qt = gptq_quantize_weight(w, 2 * x.T @ x, bits=4, group_size=32)
    w_hat = dequantize(qt)
    assert torch.isfinite(w_hat).all()
    assert out_err(x, w, w_hat) < out_err(x, w, fake_quantize(w, 4, axis=-1, group_size=32))


def test_gptq_rejects_bad_arguments():
    w, x = correlated_problem()
    with pytest.raises(InputError, match="group_size"):
        gptq_quantize_weight(w, x.T @ x, bits=4, group_size=48)
    with pytest.raises(InputError, match="bits"):
        gptq_quantize_weight(w, x.T @ x, bits=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    ckpt = load_checkpoint(path, show_progress=False)
    return LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)


def tiny_calib(n=3, length=40):
    return [torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(s)) for s in range(n)]


def test_awq_scaling_keeps_the_float_layer_function(tiny_model):
    """Folding 1/s into the norms and up_proj and s into the weights must not change the float layer."""
    xs = layer0_inputs(tiny_model, tiny_calib())
    rotary = float_rotary(tiny_model)
    layer = tiny_model.model.layers[1]
    scaled = copy.deepcopy(layer)
    awq_quantize_layer(scaled, xs, rotary, bits=3, group_size=16)
    assert not torch.allclose(scaled.input_layernorm.weight, layer.input_layernorm.weight)
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(
                run_layer(scaled, x, rotary), run_layer(layer, x, rotary), rtol=1e-4, atol=1e-4
            )


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_whole_model_result_names_and_layout(tiny_model, method):
    model = copy.deepcopy(tiny_model)
    if method == "awq":
        qts = awq_quantize_model(model, tiny_calib(), bits=4, group_size=16, show_progress=False)
    else:
        qts = gptq_quantize_model(model, tiny_calib(), bits=4, group_size=16, show_progress=False)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert set(qts) == set(linears)
    for name, qt in qts.items():
        w = linears[name].weight
        assert qt.codes.shape == w.shape and qt.scale.shape == (w.shape[0], w.shape[1] // 16), name
        assert (qt.bits, qt.axis, qt.group_size) == (4, 1, 16)
    with pytest.raises(InputError, match="group_size 48 does not divide"):
        gptq_quantize_model(model, tiny_calib(), bits=4, group_size=48, show_progress=False)


# --- a real layer of the default model, on real calibration text -------------------------------------


@pytest.fixture(scope="module")
def layer3():
    """Layer 3 of the default model and its real inputs for 4 wikitext-2 valid windows of 512 tokens."""
    path = resolve_model_path("default")
    ckpt = load_checkpoint(path, show_progress=False)
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)
    calib = load_calibration(DATA / "valid.txt", Tokenizer.from_checkpoint(path), num_samples=4, seq_len=512)
    rotary = float_rotary(model)
    xs = layer0_inputs(model, calib)
    with torch.no_grad():
        for layer in model.model.layers[:3]:
            xs = [run_layer(layer, x, rotary) for x in xs]
        layer = model.model.layers[3]
        ref = [run_layer(layer, x, rotary) for x in xs]
    return layer, xs, ref, rotary


def layer_error(layer, qts, xs, ref, rotary) -> float:
    """Squared error of the whole decoder layer's output with every linear replaced by its dequantized form."""
    mods = dict(layer.named_modules())
    with torch.no_grad():
        for name, qt in qts.items():
            mods[name].weight.copy_(dequantize(qt))
        return sum(((run_layer(layer, x, rotary) - r) ** 2).sum().item() for x, r in zip(xs, ref))


def rtn_layer_error(layer, xs, ref, rotary, bits, group_size) -> float:
    work = copy.deepcopy(layer)
    qts = {
        n: quantize(m.weight.detach(), bits, axis=-1, group_size=group_size)
        for n, m in work.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    return layer_error(work, qts, xs, ref, rotary)


def test_awq_beats_rtn_on_a_real_layer(layer3):
    layer, xs, ref, rotary = layer3
    rtn = rtn_layer_error(layer, xs, ref, rotary, 4, 32)
    work = copy.deepcopy(layer)
    awq = layer_error(work, awq_quantize_layer(work, xs, rotary, bits=4, group_size=32), xs, ref, rotary)
    assert awq < 0.8 * rtn, (awq, rtn)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_a_real_layer(layer3, act_order):
    from pagedllm.quantization.gptq import gptq_quantize_layer

    layer, xs, ref, rotary = layer3
    rtn = rtn_layer_error(layer, xs, ref, rotary, 4, 32)
    work = copy.deepcopy(layer)
    qts = gptq_quantize_layer(work, xs, rotary, bits=4, group_size=32, act_order=act_order)
    gptq = layer_error(work, qts, xs, ref, rotary)
    assert gptq < 0.8 * rtn, (gptq, rtn)
