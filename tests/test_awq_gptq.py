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
        qt = gptq_quantize_weight(w, torch.eye(w.shape[1]), bits=4, group_size=g, damp=0.0, ranges="minmax")
        ref = quantize(w, 4, axis=-1, group_size=g) if g else quantize(w, 4, axis=0)
        assert torch.equal(qt.codes, ref.codes) and qt.codes.dtype == torch.uint8
        assert torch.equal(qt.scale, ref.scale) and torch.equal(qt.zero_point, ref.zero_point)
        assert (qt.axis, qt.group_size) == (ref.axis, ref.group_size)


@pytest.mark.parametrize("ranges", ["minmax", "search"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, None])
def test_gptq_beats_rtn_on_a_correlated_problem(act_order, group_size, ranges):
    w, x = correlated_problem()
    h = 2 * x.T @ x / x.shape[0]
    qt = gptq_quantize_weight(w, h, 3, group_size, act_order=act_order, block_size=64, ranges=ranges)
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
    with pytest.raises(InputError, match="ranges must be one of minmax, shrink, search"):
        gptq_quantize_weight(w, x.T @ x, bits=4, ranges="mse")


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


# --- act-order, true-sequential, AWQ options ----------------------------------------------------------


def test_gptq_act_order_is_the_default():
    import inspect

    from pagedllm.quantization.gptq import gptq_quantize_layer

    for fn in (gptq_quantize_weight, gptq_quantize_layer, gptq_quantize_model):
        assert inspect.signature(fn).parameters["act_order"].default is True, fn.__name__


def test_gptq_act_order_uses_each_columns_own_stored_group():
    """Act-order visits columns by decreasing diag(H), but every column must use the (s, z) of its own
    contiguous group in the stored layout. With a diagonal H no error spreads, so the result must be
    RTN's bit for bit whatever the visiting order; a mix-up of groups would show."""
    w, _ = correlated_problem()
    d = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) * 10 + 0.1
    qt = gptq_quantize_weight(w, torch.diag(d), 4, 32, act_order=True, damp=0.0, ranges="minmax")
    ref = quantize(w, 4, axis=-1, group_size=32)
    assert torch.equal(qt.codes, ref.codes)
    assert torch.equal(qt.scale, ref.scale) and torch.equal(qt.zero_point, ref.zero_point)


def test_gptq_true_sequential_leaves_the_layer_and_sees_quantized_inputs(tiny_model):
    from pagedllm.quantization.gptq import gptq_quantize_layer

    xs = layer0_inputs(tiny_model, tiny_calib())
    rotary = float_rotary(tiny_model)
    layer = copy.deepcopy(tiny_model.model.layers[1])
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    seq = gptq_quantize_layer(layer, xs, rotary, bits=3, group_size=16, true_sequential=True)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    flat = gptq_quantize_layer(layer, xs, rotary, bits=3, group_size=16, true_sequential=False)
    # q/k/v read the same (float) input either way; o_proj's input comes from quantized q/k/v only in
    # true-sequential mode
    assert torch.equal(seq["self_attn.q_proj"].codes, flat["self_attn.q_proj"].codes)
    assert not torch.equal(seq["self_attn.o_proj"].codes, flat["self_attn.o_proj"].codes)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(block_objective=False, clip_asymmetric=False),
    ],
)
def test_awq_options_keep_the_float_layer_function(tmp_path, options):
    """Every fold (norms, up_proj rows) must leave the float layer computing the same function, under
    grouped-query attention and with biases."""
    path = save_tiny_llama(tmp_path / "tiny", attention_bias=True)
    ckpt = load_checkpoint(path, show_progress=False)
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)
    assert model.config.num_kv_heads < model.config.num_heads
    xs = layer0_inputs(model, tiny_calib())
    rotary = float_rotary(model)
    layer = model.model.layers[0]
    scaled = copy.deepcopy(layer)
    awq_quantize_layer(scaled, xs, rotary, bits=3, group_size=16, **options)
    assert not torch.allclose(scaled.input_layernorm.weight, layer.input_layernorm.weight)
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(
                run_layer(scaled, x, rotary), run_layer(layer, x, rotary), rtol=1e-4, atol=1e-4
            )


def test_quantize_cli_act_order_flag(capsys, tmp_path, monkeypatch):
    """--no-act-order reaches gptq_quantize_model; with another method it is an input error (exit 2)."""
    import pagedllm.quantization.gptq as gptq
    from pagedllm.entrypoints.cli.main import main

    path = save_tiny_llama(tmp_path / "tiny")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 200))
    seen = {}

    def fake(model, calib, bits, group_size, show_progress, **kwargs):
        seen.update(kwargs)
        return gptq_quantize_model(model, calib[:1], bits, group_size, show_progress=False, **kwargs)

    monkeypatch.setattr(gptq, "gptq_quantize_model", fake)

    def cli(*argv):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
        return rc, capsys.readouterr().err

    base = ["quantize", "--model", str(path), "--calib", str(calib), "--num-samples", "2", "--seq-len", "16"]
    assert cli(*base, "--method", "gptq", "--out", str(tmp_path / "a"), "--quiet")[0] == 0
    assert seen == {"act_order": True}
    assert cli(*base, "--method", "gptq", "--no-act-order", "--out", str(tmp_path / "b"), "--quiet")[0] == 0
    assert seen == {"act_order": False}
    rc, err = cli(*base, "--method", "awq", "--no-act-order", "--out", str(tmp_path / "c"), "--quiet")
    assert rc == 2 and "--no-act-order applies to --method gptq only" in err, err


@pytest.mark.parametrize("asymmetric", [False, True, "pairs"])
def test_range_search_never_worse_than_minmax_and_keeps_ranges_valid(asymmetric):
    from pagedllm.quantization.calib import quantize_weight, search_ranges

    w, x = correlated_problem()
    w[:4] = w[:4].abs() + 0.5  # rows whose groups are all positive: the two ends could cross
    w[4:8] = -w[4:8].abs() - 0.5
    gram = x.T @ x
    for g in (32, None):
        lo, hi = search_ranges(w, gram, 4, g, asymmetric=asymmetric)
        assert (lo <= hi).all()
        gs = g or w.shape[1]

        def objective(w_hat, gs=gs):  # what the search minimises: each group's error on its own inputs
            d = (w_hat - w).reshape(w.shape[0], -1, gs)
            xg = x.reshape(x.shape[0], -1, gs)
            return torch.einsum("tgk,ogk->tog", xg, d).pow(2).sum().item()

        found = objective(dequantize(quantize_weight(w, 4, g, lo, hi)))
        assert found <= objective(dequantize(quantize_weight(w, 4, g))) * (1 + 1e-5)
