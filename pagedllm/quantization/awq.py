"""AWQ: activation-aware weight quantization (Lin et al. 2023, llm-awq / AutoAWQ), per decoder layer.

A few input channels carry much larger activations than the rest, and the weights they multiply matter
most. Scaling those weight columns up by s (and the activations down by 1/s, folded into whatever
produces them) gives them a finer share of the quantization grid at no cost in float:

    y = (x / s) (W diag(s))^T      s = mean|x|^alpha, alpha picked from a grid on [0, 1)

s = 1 (plain round-to-nearest) is always a candidate, so the search can only improve on it. Groups of
linears that share an input share s:
    q/k/v  after input_layernorm          (1/s folded into the norm weight)
    gate/up after post_attention_layernorm (1/s folded into the norm weight)
    down   after up_proj                  (1/s folded into up_proj's rows: silu(g) * (u/s) = (silu(g)*u)/s)
As in the reference, the q/k/v scales are judged on the attention block's output and the gate/up scales
on the MLP's output (block_objective), down_proj's on its own output. o_proj is left unscaled: with
grouped-query attention v_proj has fewer outputs than o_proj has inputs, so s would have to be shared by
the query heads of one KV head; tried (1/s folded into v_proj), it raised the layer output error on the
default model, as did AutoAWQ's duo scaling (s = mean|x|^a / mean|w|^(1-a)), so neither is kept.

Then a clipping search picks each group's [rmin, rmax] (values beyond saturate) where that lowers the
group's output error: both ends scaled by one factor on the grid 1, 0.95, ... 0.55 (the reference's
search) and every pair of factors for the two ends (clip_asymmetric, calib.search_ranges), which also
chooses where the integer zero point puts the grid. q/k are not clipped (as in llm-awq: it hurts attention scores).

Linear-output errors are measured with Gram matrices G = X^T X of the calibration inputs:
||X (W - W_q)^T||^2 = sum((D G) * D) with D = W - W_q, exact over every calibration token and cheaper
than re-running the matmuls when in_features < tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.norm import GemmaRMSNorm
from pagedllm.quantization.calib import (
    check_group_size,
    collect_inputs,
    prefill_metadata,
    quantize_layers,
    quantize_weight,
    search_ranges,
)
from pagedllm.quantization.uniform import QuantizedTensor, check_bits, dequantize

# The distinct inputs of a layer: each group of linears below reads one of them.
_INPUTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def output_error(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """||X D^T||_F^2 for D [out, in] given G = X^T X [in, in]."""
    return ((d @ gram) * d).sum()


def candidate_scales(act_mean: torch.Tensor, n_grid: int) -> list[torch.Tensor]:
    """The grid of per-input-channel scales act_mean^a, a in [0, 1), each centred around 1 (the quantization
    grid only cares about ratios). a = 0 is s = 1, plain round-to-nearest, so the search never does worse
    than RTN on its objective."""
    out = []
    for i in range(n_grid):
        s = act_mean.pow(i / n_grid).clamp(min=1e-4)
        out.append(s / (s.max() * s.min()).sqrt())
    return out


def fake_quantize_scaled(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Q(W diag(s)) diag(s)^-1: the weight the float input x sees once s is folded into the layer."""
    return dequantize(quantize_weight(w * s, bits, group_size)) / s


# AWQ's clipping search: per-group ranges shrunk where that lowers each group's partial output error
# (calib.search_ranges; the groups are chosen independently, as in llm-awq)
search_clip = search_ranges


class _Stats:
    """Running Gram matrix and mean |x| per input channel of one linear's input (and the inputs, if kept)."""

    def __init__(self, keep: bool = False):
        self.gram: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.samples: list[torch.Tensor] | None = [] if keep else None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        g, a = x.T @ x, x.abs().sum(0)
        self.gram = g if self.gram is None else self.gram + g
        self.abs_sum = a if self.abs_sum is None else self.abs_sum + a
        self.count += x.shape[0]
        if self.samples is not None:
            self.samples.append(x)

    @property
    def act_mean(self) -> torch.Tensor:
        return self.abs_sum / self.count


def _attention(attn: nn.Module, x: torch.Tensor, rotary) -> torch.Tensor:
    """The attention module alone on one whole sequence x [T, hidden] (already normed), fresh KV cache."""
    meta, num_blocks = prefill_metadata(x.shape[0])
    cache = torch.zeros(2, num_blocks, meta.block_size, attn.num_kv_heads, attn.head_dim, dtype=x.dtype)
    return attn(x, rotary.cos_sin(attn, torch.arange(x.shape[0]), x.dtype), cache, meta)


def _fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """The norm's output divided by s: its weight, or for Gemma's (1 + weight) norms the whole factor."""
    if isinstance(norm, GemmaRMSNorm):
        norm.weight.copy_((1.0 + norm.weight) / s - 1.0)
    else:
        norm.weight.div_(s)


def _spread_tokens(samples: list[torch.Tensor], n: int) -> torch.Tensor:
    """At most n tokens, evenly spaced over all samples' tokens."""
    x = torch.cat(samples)
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n).long()]


def awq_quantize_layer(
    layer: nn.Module,
    xs: list[torch.Tensor],
    rotary,
    bits: int = 4,
    group_size: int | None = 32,
    n_grid: int = 20,
    clip: bool = True,
    block_objective: bool = True,
    block_tokens: int = 2048,
    clip_asymmetric: bool | str = "pairs",
) -> dict[str, QuantizedTensor]:
    """AWQ on one float32 decoder layer, in place: scales folded into its norms/weights, returns the codes.

    Returned names are relative to the layer ("self_attn.q_proj", ...); dequantizing them and putting
    the result in the (already scaled) layer gives the quantized layer.

    block_objective: q/k/v scales are judged on the attention output and gate/up scales on the MLP output
    (on block_tokens evenly spaced tokens), as in the reference; otherwise on the linears' own outputs.
    clip_asymmetric: "pairs" tries every pair of factors for the two range ends (the default: on the
    default model it beat True, the cheaper coordinate search: after the symmetric grid each end alone;
    False is the reference's symmetric grid only; calib.search_ranges), steps of 1/n_grid down to half
    the range.
    """
    keep = {"self_attn.q_proj", "mlp.gate_proj"} if block_objective else set()
    stats = {n: _Stats(keep=n in keep) for n in _INPUTS}
    collect_inputs(layer, xs, rotary, _INPUTS, on_input=lambda n, x: stats[n].add(x))
    attn, mlp = layer.self_attn, layer.mlp
    grams = {n: st.gram for n, st in stats.items()}

    def search(linears: list[nn.Linear], inp: str, block) -> torch.Tensor:
        w = torch.cat([m.weight for m in linears]).detach()
        cands = candidate_scales(stats[inp].act_mean, n_grid)
        if block is None:  # the linears' own outputs, exactly, through the Gram matrix
            errs = [
                output_error(fake_quantize_scaled(w, c, bits, group_size) - w, grams[inp]).item()
                for c in cands
            ]
            return cands[min(range(len(cands)), key=errs.__getitem__)]
        inputs, run = block
        originals = [m.weight.detach().clone() for m in linears]
        ref = [run(x) for x in inputs]
        best_err, best = float("inf"), cands[0]
        try:
            for c in cands:
                for m, w0 in zip(linears, originals):
                    m.weight.copy_(fake_quantize_scaled(w0, c, bits, group_size))
                err = sum(((run(x) - r) ** 2).sum().item() for x, r in zip(inputs, ref))
                if err < best_err:
                    best_err, best = err, c
        finally:
            for m, w0 in zip(linears, originals):
                m.weight.copy_(w0)
        return best

    def scale_group(linears, inp: str, fold, block=None) -> None:
        s = search(linears, inp, block)
        for m in linears:
            m.weight.mul_(s)  # columns: W diag(s)
        fold(s)
        grams[inp] = grams[inp] / torch.outer(s, s)  # the Gram matrix of the scaled inputs X / s

    with torch.no_grad():
        attn_block = mlp_block = None
        if block_objective:
            attn_block = (stats["self_attn.q_proj"].samples, lambda x: _attention(attn, x, rotary))
            mlp_block = ([_spread_tokens(stats["mlp.gate_proj"].samples, block_tokens)], mlp)
        scale_group(
            [attn.q_proj, attn.k_proj, attn.v_proj],
            "self_attn.q_proj",
            lambda s: _fold_into_norm(layer.input_layernorm, s),
            block=attn_block,
        )
        scale_group(
            [mlp.gate_proj, mlp.up_proj],
            "mlp.gate_proj",
            # the norm the MLP reads: Gemma's pre_feedforward_layernorm, Llama's post_attention_layernorm
            lambda s: _fold_into_norm(layer.pre_feedforward_layernorm or layer.post_attention_layernorm, s),
            block=mlp_block,
        )
        scale_group([mlp.down_proj], "mlp.down_proj", lambda s: mlp.up_proj.weight.div_(s[:, None]))

    groups = [
        (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.q_proj"),
        (("self_attn.o_proj",), "self_attn.o_proj"),
        (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj"),
        (("mlp.down_proj",), "mlp.down_proj"),
    ]
    modules = dict(layer.named_modules())
    out: dict[str, QuantizedTensor] = {}
    for names, inp in groups:
        for name in names:
            w = modules[name].weight.detach()
            rng = (None, None)
            if clip and not name.endswith(("q_proj", "k_proj")):
                rng = search_clip(w, grams[inp], bits, group_size, n_grid, asymmetric=clip_asymmetric)
            out[name] = quantize_weight(w, bits, group_size, *rng)
    return out


def awq_quantize_model(
    model: nn.Module,
    calib: list[torch.Tensor],
    bits: int = 4,
    group_size: int | None = 32,
    n_grid: int = 20,
    clip: bool = True,
    show_progress: bool = True,
    block_objective: bool = True,
    clip_asymmetric: bool | str = "pairs",
) -> dict[str, QuantizedTensor]:
    """AWQ for every decoder layer; returns {"model.layers.i.self_attn.q_proj": QuantizedTensor, ...}.

    Changes the model in place: the scales are folded into the RMSNorm weights, up_proj rows and the
    linears' weights (the float model computes the same function). Swap the linears for quantized ones
    built from the result, e.g. weight = dequantize(qt). Options: awq_quantize_layer.
    """
    check_bits(bits)
    check_group_size(model, group_size)

    def one(layer, xs, rotary):
        return awq_quantize_layer(
            layer,
            xs,
            rotary,
            bits,
            group_size,
            n_grid,
            clip,
            block_objective=block_objective,
            clip_asymmetric=clip_asymmetric,
        )

    return quantize_layers(model, calib, one, desc=f"AWQ int{bits}", show_progress=show_progress)


__all__ = ["awq_quantize_model", "awq_quantize_layer", "search_clip"]
