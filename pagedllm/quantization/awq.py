"""AWQ: activation-aware weight quantization (Lin et al. 2023, llm-awq / AutoAWQ), per decoder layer.

A few input channels carry much larger activations than the rest, and the weights they multiply matter
most. Scaling those weight columns up by s (and the activations down by 1/s, folded into whatever
produces them) gives them a finer share of the quantization grid at no cost in float:

    y = (x / s) (W diag(s))^T      s = mean|x|^alpha, alpha picked from a grid on [0, 1]

alpha = 0 is plain round-to-nearest, so the search can only improve on it. Groups of linears that share an
input share s:
    q/k/v  after input_layernorm          (1/s folded into the norm weight)
    gate/up after post_attention_layernorm (1/s folded into the norm weight)
    down   after up_proj                  (1/s folded into up_proj's rows: silu(g) * (u/s) = (silu(g)*u)/s)
o_proj is left unscaled: with grouped-query attention v_proj has fewer outputs than o_proj has inputs.

Then a clipping search shrinks each group's [min, max] range (values beyond it saturate) where that
lowers the group's output error; q/k are not clipped (as in llm-awq: it hurts attention scores).

Errors are measured with Gram matrices G = X^T X of the calibration inputs: ||X (W - W_q)^T||^2 =
sum((D G) * D) with D = W - W_q, exact over every calibration token and cheaper than re-running the
matmuls when in_features < tokens. The scale objective is the group's linear outputs (q/k/v or gate/up
concatenated) rather than the attention or MLP block output: blocks need whole sequences and cost ~5x.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.calib import (
    check_group_size,
    collect_inputs,
    quantize_layers,
    quantize_weight,
)
from pagedllm.quantization.uniform import QuantizedTensor, check_bits, dequantize

# The distinct inputs of a layer: each group of linears below reads one of them.
_INPUTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def output_error(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """||X D^T||_F^2 for D [out, in] given G = X^T X [in, in]."""
    return ((d @ gram) * d).sum()


def search_scales(
    w: torch.Tensor,
    gram: torch.Tensor,
    act_mean: torch.Tensor,
    bits: int,
    group_size: int | None,
    n_grid: int = 20,
) -> torch.Tensor:
    """Per-input-channel s = act_mean^alpha that minimises ||X W^T - X (Q(W s) / s)^T||^2 over the grid."""
    best_err, best_s = float("inf"), torch.ones_like(act_mean)
    for alpha in torch.linspace(0, 1, n_grid).tolist():
        s = act_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1: the grid only cares about ratios
        w_q = dequantize(quantize_weight(w * s, bits, group_size)) / s
        err = output_error(w_q - w, gram).item()
        if err < best_err:
            best_err, best_s = err, s
    return best_s


def search_clip(
    w: torch.Tensor,
    gram: torch.Tensor,
    bits: int,
    group_size: int | None,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ranges (rmin, rmax), shrunk by up to max_shrink, minimising each group's partial output error.

    Each group's error is d_g^T G_g d_g with G_g the diagonal block of the Gram matrix for its input
    channels: the groups are chosen independently, as in llm-awq.
    """
    out_f, in_f = w.shape
    gs = group_size or in_f
    ng = in_f // gs
    # diagonal blocks [ng, gs, gs] of G
    blocks = gram.reshape(ng, gs, ng, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    wg = w.reshape(out_f, ng, gs)
    lo, hi = wg.amin(-1), wg.amax(-1)
    best_err = torch.full((out_f, ng), float("inf"))
    best_lo, best_hi = lo.clone(), hi.clone()
    for i in range(int(max_shrink * n_grid)):
        r = 1 - i / n_grid
        rmin, rmax = lo * r, hi * r
        if not group_size:
            rmin, rmax = rmin[:, 0], rmax[:, 0]
        d = (dequantize(quantize_weight(w, bits, group_size, rmin, rmax)) - w).reshape(out_f, ng, gs)
        err = (torch.einsum("ogk,gkl->ogl", d, blocks) * d).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, lo * r, best_lo)
        best_hi = torch.where(better, hi * r, best_hi)
    if not group_size:
        return best_lo[:, 0], best_hi[:, 0]
    return best_lo, best_hi


class _Stats:
    """Running Gram matrix and mean |x| per input channel of one linear's input."""

    def __init__(self):
        self.gram: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        g, a = x.T @ x, x.abs().sum(0)
        self.gram = g if self.gram is None else self.gram + g
        self.abs_sum = a if self.abs_sum is None else self.abs_sum + a
        self.count += x.shape[0]

    @property
    def act_mean(self) -> torch.Tensor:
        return self.abs_sum / self.count


def awq_quantize_layer(
    layer: nn.Module,
    xs: list[torch.Tensor],
    rotary,
    bits: int = 4,
    group_size: int | None = 32,
    n_grid: int = 20,
    clip: bool = True,
) -> dict[str, QuantizedTensor]:
    """AWQ on one float32 decoder layer, in place: scales folded into its norms/weights, returns the codes.

    Returned names are relative to the layer ("self_attn.q_proj", ...); dequantizing them and putting
    the result in the (already scaled) layer gives the quantized layer.
    """
    stats = {n: _Stats() for n in _INPUTS}
    collect_inputs(layer, xs, rotary, _INPUTS, on_input=lambda n, x: stats[n].add(x))
    attn, mlp = layer.self_attn, layer.mlp
    grams = {n: st.gram for n, st in stats.items()}

    def scale_group(linears: list[nn.Linear], inp: str, fold) -> None:
        w = torch.cat([m.weight for m in linears])
        s = search_scales(w, grams[inp], stats[inp].act_mean, bits, group_size, n_grid)
        with torch.no_grad():
            for m in linears:
                m.weight.mul_(s)  # columns: W diag(s)
            fold(s)
        grams[inp] = grams[inp] / torch.outer(s, s)  # the Gram matrix of the scaled inputs X / s

    with torch.no_grad():
        scale_group(
            [attn.q_proj, attn.k_proj, attn.v_proj],
            "self_attn.q_proj",
            lambda s: layer.input_layernorm.weight.div_(s),
        )
        scale_group(
            [mlp.gate_proj, mlp.up_proj],
            "mlp.gate_proj",
            lambda s: layer.post_attention_layernorm.weight.div_(s),
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
                rng = search_clip(w, grams[inp], bits, group_size, n_grid)
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
) -> dict[str, QuantizedTensor]:
    """AWQ for every decoder layer; returns {"model.layers.i.self_attn.q_proj": QuantizedTensor, ...}.

    Changes the model in place: the scales are folded into the RMSNorm weights, up_proj rows and the
    linears' weights (the float model computes the same function). Swap the linears for quantized ones
    built from the result, e.g. weight = dequantize(qt).
    """
    check_bits(bits)
    check_group_size(model, group_size)

    def one(layer, xs, rotary):
        return awq_quantize_layer(layer, xs, rotary, bits, group_size, n_grid, clip)

    return quantize_layers(model, calib, one, desc=f"AWQ int{bits}", show_progress=show_progress)


__all__ = ["awq_quantize_model", "awq_quantize_layer", "search_scales", "search_clip"]
