"""Calibration samples and the layer-by-layer driver shared by AWQ and GPTQ."""

from __future__ import annotations

import pytest
import torch
from model_helpers import paged_prefill_logits
from tiny_models import save_tiny_llama

from pagedllm.errors import InputError
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint
from pagedllm.quantization.calib import (
    float_rotary,
    layer0_inputs,
    load_calibration,
    quantize_layers,
    quantize_weight,
    run_layer,
)
from pagedllm.quantization.uniform import dequantize


class WordTokenizer:
    """One id per whitespace-separated word: the id is the word's number, so windows are checkable."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens, "calibration text must not get BOS/EOS inserted"
        return [int(w) for w in text.split()]


def write_words(path, n: int):
    path.write_text(" ".join(str(i) for i in range(n)))
    return path


def test_samples_are_seeded_non_overlapping_windows(tmp_path):
    f = write_words(tmp_path / "t.txt", 1000)
    samples = load_calibration(f, WordTokenizer(), num_samples=6, seq_len=64, seed=3)
    assert len(samples) == 6
    starts = []
    for s in samples:
        assert s.dtype == torch.long and s.shape == (64,)
        start = int(s[0])
        assert start % 64 == 0 and torch.equal(s, torch.arange(start, start + 64))  # one aligned window
        starts.append(start)
    assert len(set(starts)) == 6  # no window twice, so no overlap
    again = load_calibration(f, WordTokenizer(), num_samples=6, seq_len=64, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(samples, again))
    other = load_calibration(f, WordTokenizer(), num_samples=6, seq_len=64, seed=4)
    assert [int(s[0]) for s in other] != starts


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist") as e:
        load_calibration(tmp_path / "nope.txt", WordTokenizer())
    assert e.value.param == "calib"


def test_too_little_text_names_the_numbers(tmp_path):
    f = write_words(tmp_path / "t.txt", 1000)
    with pytest.raises(InputError) as e:
        load_calibration(f, WordTokenizer(), num_samples=16, seq_len=128)
    msg = str(e.value)
    assert "1000 tokens" in msg and "7 windows of 128" in msg and "2048 tokens" in msg
    # exactly enough is fine
    assert len(load_calibration(f, WordTokenizer(), num_samples=7, seq_len=128)) == 7


@pytest.mark.parametrize("kwargs", [dict(num_samples=0), dict(seq_len=1), dict(num_samples=2.5)])
def test_bad_sizes(tmp_path, kwargs):
    f = write_words(tmp_path / "t.txt", 100)
    with pytest.raises(InputError):
        load_calibration(f, WordTokenizer(), **kwargs)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    ckpt = load_checkpoint(path, show_progress=False)
    return LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)


def test_layer_by_layer_equals_model_forward(tiny_model):
    """Embeddings, then each layer on its own tiny cache, then the final norm: the model's own logits."""
    ids = torch.randint(3, tiny_model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    (x,) = layer0_inputs(tiny_model, [ids])
    rotary = float_rotary(tiny_model)
    with torch.no_grad():
        for layer in tiny_model.model.layers:
            x = run_layer(layer, x, rotary)
        logits = tiny_model.compute_logits(tiny_model.model.norm(x))
    expected = paged_prefill_logits(tiny_model, ids.tolist())
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_driver_feeds_each_layer_the_quantized_outputs(tiny_model):
    """Layer i+1 must be calibrated on what quantized layer i produces, not on float activations."""
    model = LlamaForCausalLM.from_weights(tiny_model.config, dict(tiny_model.state_dict()), torch.float32)
    calib = [torch.randint(3, 1000, (20,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    seen: list[list[torch.Tensor]] = []

    def rtn2(layer, xs, rotary):  # 2-bit RTN: far from the float layer, so the difference shows
        seen.append([x.clone() for x in xs])
        return {n: quantize_weight(m.weight.detach(), 2, 16) for n, m in layer.named_modules() if "proj" in n}

    qts = quantize_layers(model, calib, rtn2, desc="test", show_progress=False)
    assert len(qts) == 7 * model.config.num_layers and "model.layers.0.self_attn.q_proj" in qts
    # replay: quantized layer 0 on the embeddings gives exactly what layer 1 was shown
    layer0 = LlamaForCausalLM.from_weights(model.config, dict(tiny_model.state_dict()), torch.float32)
    mods = dict(layer0.named_modules())
    with torch.no_grad():
        for n, qt in qts.items():
            mods[n].weight.copy_(dequantize(qt))
        x1 = run_layer(layer0.model.layers[0], layer0_inputs(layer0, calib[:1])[0], float_rotary(layer0))
        x1_float = run_layer(tiny_model.model.layers[0], seen[0][0], float_rotary(tiny_model))
    torch.testing.assert_close(seen[1][0], x1)
    assert not torch.allclose(seen[1][0], x1_float, atol=1e-3)


def test_stop_early_collects_the_same_inputs(tiny_model):
    """stop_early ends each sample's forward once the wanted linears have run: same inputs, and the
    linears after them are never reached."""
    from pagedllm.quantization.calib import collect_inputs

    calib = [torch.randint(3, 1000, (20,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    xs = layer0_inputs(tiny_model, calib)
    rotary = float_rotary(tiny_model)
    layer = tiny_model.model.layers[0]
    full = collect_inputs(layer, xs, rotary)
    reached = []
    hook = layer.mlp.down_proj.register_forward_hook(lambda *a: reached.append(1))
    try:
        early = collect_inputs(layer, xs, rotary, ("self_attn.o_proj",), stop_early=True)
    finally:
        hook.remove()
    assert not reached
    torch.testing.assert_close(early["self_attn.o_proj"], full["self_attn.o_proj"])
