"""Calibration data and the layer-by-layer driver shared by AWQ and GPTQ.

Both methods quantize one decoder layer at a time (Lin et al. 2023; Frantar et al. 2022): capture what
enters layer 0 for every calibration sample, then for each layer collect the inputs of its linears,
quantize them, and run the *quantized* layer to get the next layer's inputs, so later layers are
calibrated on the activations they will really see. Only one layer is ever in float32 working form.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.errors import InputError
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.quantization.uniform import QuantizedTensor, dequantize, qparams, quantize, round_half_up

# The linears of one Llama decoder layer, in the order data flows through them.
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def load_calibration(
    path: str | Path, tokenizer, num_samples: int = 64, seq_len: int = 512, seed: int = 0
) -> list[torch.LongTensor]:
    """`num_samples` random, non-overlapping windows of `seq_len` tokens from a text file.

    The file is tokenized once as a whole (no special tokens), cut into consecutive windows, and a seeded
    random choice of them is returned, so the same seed always gives the same samples.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise InputError(f"num_samples must be a whole number >= 1, got {num_samples!r}", "num_samples")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise InputError(f"seq_len must be a whole number >= 2, got {seq_len!r}", "seq_len")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"calibration file {path} does not exist", param="calib")
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    available = len(ids) // seq_len
    if available < num_samples:
        raise InputError(
            f"calibration file {path} gives {len(ids)} tokens = {available} windows of {seq_len}; "
            f"{num_samples} samples need at least {num_samples * seq_len} tokens",
            param="calib",
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randperm(available, generator=g)[:num_samples] * seq_len
    all_ids = torch.tensor(ids, dtype=torch.long)
    return [all_ids[s : s + seq_len].clone() for s in starts.tolist()]


def prefill_metadata(num_tokens: int, block_size: int = 16) -> tuple[AttentionMetadata, int]:
    """Metadata for one sequence prefilled from scratch over blocks 0..n-1; returns (meta, num_blocks)."""
    num_blocks = -(-num_tokens // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        block_tables=torch.arange(num_blocks).unsqueeze(0),
        num_decodes=1 if num_tokens == 1 else 0,
        seq_lens_tensor=torch.tensor([num_tokens]),
        block_size=block_size,
    )
    return meta, num_blocks


@dataclass
class CalibRotary:
    """The model's RoPE tables in float32 (a bf16 model keeps them in bf16), both where Gemma 3's sliding
    layers have their own base."""

    rotary: RotaryEmbedding
    local: RotaryEmbedding | None = None

    def cos_sin(self, attn: nn.Module, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin for the attention module `attn` (its layer's table) at `positions`."""
        local = self.local is not None and attn.sliding_window is not None
        return (self.local if local else self.rotary).cos_sin(positions, dtype)


def run_layer(layer: nn.Module, x: torch.Tensor, rotary: CalibRotary) -> torch.Tensor:
    """One decoder layer on one whole sequence x [T, D], with a fresh paged KV cache of its own."""
    attn = layer.self_attn
    meta, num_blocks = prefill_metadata(x.shape[0])
    cache = torch.zeros(2, num_blocks, meta.block_size, attn.num_kv_heads, attn.head_dim, dtype=x.dtype)
    rope = rotary.cos_sin(attn, torch.arange(x.shape[0]), x.dtype)
    return layer(x, rope, cache, meta)


def layer0_inputs(model: nn.Module, calib: list[torch.Tensor]) -> list[torch.Tensor]:
    """What enters decoder layer 0 for each sample: the (scaled, for Gemma) embeddings, in float32."""
    with torch.no_grad():
        return [model.embed(ids).float() for ids in calib]


def float_rotary(model: nn.Module) -> CalibRotary:
    local = model.rotary_local
    return CalibRotary(copy.deepcopy(model.rotary).float(), copy.deepcopy(local).float() if local else None)


class _StopForward(Exception):
    """Raised by collect_inputs' hooks once every wanted input of a sample is seen (the rest is not needed)."""


def collect_inputs(
    layer: nn.Module,
    xs: list[torch.Tensor],
    rotary: CalibRotary,
    names: tuple[str, ...] = LINEARS,
    on_input: Callable[[str, torch.Tensor], None] | None = None,
    stop_early: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Run the layer over every sample and hand each named linear's input [T, in] to on_input.

    Without on_input the inputs are concatenated over samples and returned (name -> [all T, in]).
    stop_early ends each sample's forward as soon as all named linears have been reached (e.g. only
    q_proj's input needs just the input norm), which matters when a layer is run once per linear group.
    """
    store: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    sink = on_input or (lambda name, x: store[name].append(x))
    modules = dict(layer.named_modules())
    seen: set[str] = set()

    def hook(name: str, x: torch.Tensor) -> None:
        sink(name, x.detach())
        seen.add(name)
        if stop_early and len(seen) == len(names):
            raise _StopForward

    hooks = [modules[n].register_forward_hook(lambda m, args, out, n=n: hook(n, args[0])) for n in names]
    try:
        with torch.no_grad():
            for x in xs:
                seen.clear()
                try:
                    run_layer(layer, x, rotary)
                except _StopForward:
                    pass
    finally:
        for h in hooks:
            h.remove()
    return None if on_input else {n: torch.cat(v) for n, v in store.items()}


LayerFn = Callable[[nn.Module, list[torch.Tensor], CalibRotary], dict[str, QuantizedTensor]]


def quantize_layers(
    model: nn.Module,
    calib: list[torch.Tensor],
    quantize_layer: LayerFn,
    desc: str,
    show_progress: bool = True,
) -> dict[str, QuantizedTensor]:
    """The sequential driver: quantize_layer(fp32 copy of layer i, its inputs, rotary) -> {rel name: qt}.

    quantize_layer may change the copy's parameters in ways that keep the float layer's function (AWQ
    folds scales into norms and weights); those changes are written back into the model, in its dtype.
    The model's linears keep float weights: the caller swaps in quantized linears from the result.
    The next layer's inputs come from the quantized layer, so each layer is calibrated on what it will
    really see.
    """
    if not calib:
        raise InputError("calibration needs at least one sample", param="calib")
    check_dense(model, desc.split()[0])
    xs = layer0_inputs(model, calib)
    rotary = float_rotary(model)
    out: dict[str, QuantizedTensor] = {}
    layers = model.model.layers
    for i, layer in enumerate(tqdm(layers, desc=desc, unit="decoder layer", disable=not show_progress)):
        work = copy.deepcopy(layer).float()
        qts = quantize_layer(work, xs, rotary)
        with torch.no_grad():
            for p_model, p_work in zip(layer.parameters(), work.parameters()):
                p_model.copy_(p_work.to(p_model.dtype))
            modules = dict(work.named_modules())
            for name, qt in qts.items():
                modules[name].weight.copy_(dequantize(qt).to(torch.float32))
            xs = [run_layer(work, x, rotary) for x in xs]
        out.update({f"model.layers.{i}.{name}": qt for name, qt in qts.items()})
    return out


def check_dense(model: nn.Module, method: str) -> None:
    """Refuse a mixture-of-experts model: the layer functions here quantize a dense MLP's linears, and an
    expert's statistics would come from the few calibration tokens routed to it (none for some), so
    experts are never calibrated (nor silently skipped); round-to-nearest quantizes them."""
    if getattr(model.config, "num_experts", 0):
        raise InputError(
            f"{method} calibration of a mixture-of-experts model ({model.config.architecture}: "
            f"{model.config.num_experts} experts a layer) is not implemented; use --method rtn "
            "(or quantization='int8' / 'int4' at load)",
            param="method",
        )


def check_group_size(model: nn.Module, group_size: int | None) -> None:
    """Fail before minutes of calibration, not at the first layer that does not divide."""
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InputError(f"group_size must be a whole number >= 1, got {group_size!r}", param="group_size")
    sizes = sorted({m.in_features for m in model.model.layers.modules() if isinstance(m, nn.Linear)})
    bad = [n for n in sizes if n % group_size]
    if bad:
        raise InputError(
            f"group_size {group_size} does not divide the linears' in_features {bad}; "
            f"pick a divisor of {', '.join(map(str, sizes))}",
            param="group_size",
        )


def weight_qparams(w: torch.Tensor, bits: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of a [out, in] weight with the data's own ranges: [out, in/g], or [out] per channel."""
    out_f, in_f = w.shape
    rows = w.reshape(out_f, -1, group_size or in_f)
    s, z = qparams(rows.amin(-1), rows.amax(-1), bits)
    return (s, z) if group_size else (s[:, 0], z[:, 0])


def weight_tensor(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int | None
) -> QuantizedTensor:
    """The QuantizedTensor layout uniform.quantize gives a weight: group-wise along in_features (axis 1),
    or per output channel (axis 0) when group_size is None, so every method's result reads the same."""
    return QuantizedTensor(
        codes=codes.to(torch.uint8 if bits <= 8 else torch.int32),
        scale=scale.float().contiguous(),
        zero_point=zero.to(torch.int64).contiguous(),
        bits=bits,
        axis=1 if group_size else 0,
        group_size=group_size,
    )


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int | None, rmin=None, rmax=None
) -> QuantizedTensor:
    """Round-to-nearest of a [out, in] weight in the layout above; rmin/rmax clip each group's range."""
    if group_size:
        return quantize(w, bits, axis=1, group_size=group_size, rmin=rmin, rmax=rmax)
    return quantize(w, bits, axis=0, rmin=rmin, rmax=rmax)


def search_ranges(
    w: torch.Tensor,
    gram: torch.Tensor,
    bits: int,
    group_size: int | None,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    asymmetric: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ranges (rmin, rmax), shrunk by up to max_shrink, minimising each group's partial output error.

    Each group's error is d_g^T G_g d_g (d = round-to-nearest error) with G_g the diagonal block of the
    Gram matrix G = X^T X for its input channels, so each group is chosen independently. The candidates
    scale both ends of the data's [min, max] by one factor r = 1, 1 - 1/n_grid, ... down to 1 - max_shrink
    (AWQ's clipping grid); asymmetric then also tries each end alone on that grid with the other at its best
    so far (one round of coordinate search, ~the quality of all pairs at a third of the cost), which also
    moves where the integer zero point puts the grid; asymmetric="pairs" tries every pair of factors for
    the two ends (3x the cost of the coordinate search). Returns [out, in/g] ([out] per channel).
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
    levels = 2**bits - 1
    steps = torch.tensor([1 - i / n_grid for i in range(int(max_shrink * n_grid))])[:, None, None, None]

    def try_ranges(c_lo: torch.Tensor, c_hi: torch.Tensor) -> None:
        """Candidates [C, out, ng, 1]: keep, per group, whichever has the lowest error so far."""
        nonlocal best_err, best_lo, best_hi
        sc, z = qparams(c_lo, c_hi, bits)  # the same arithmetic as quantize() with rmin/rmax
        d = sc * (torch.clamp(round_half_up(wg / sc) + z, 0, levels) - z) - wg
        err = (torch.einsum("cogk,gkl->cogl", d, blocks) * d).sum(-1)  # [C, out, ng]
        # a group of one sign can have its ends cross (lo * 1 > hi * 0.6 when 0 < lo): not a range
        err = torch.where((c_lo <= c_hi)[..., 0], err, torch.inf)
        for e, a, b in zip(err, c_lo[..., 0], c_hi[..., 0]):
            better = e < best_err
            best_err = torch.where(better, e, best_err)
            best_lo = torch.where(better, a, best_lo)
            best_hi = torch.where(better, b, best_hi)

    if asymmetric == "pairs":  # every (lo factor, hi factor) pair, one lo factor a batch
        for f in steps:
            try_ranges(
                (lo[None, :, :, None] * f).expand(len(steps), -1, -1, -1), hi[None, :, :, None] * steps
            )
        return (best_lo[:, 0], best_hi[:, 0]) if not group_size else (best_lo, best_hi)
    try_ranges(lo[None, :, :, None] * steps, hi[None, :, :, None] * steps)
    if asymmetric:  # then each end on its own, the other kept at the best so far
        try_ranges(
            lo[None, :, :, None] * steps, best_hi[None, :, :, None].expand_as(lo[None, :, :, None] * steps)
        )
        try_ranges(
            best_lo[None, :, :, None].expand_as(hi[None, :, :, None] * steps), hi[None, :, :, None] * steps
        )
    if not group_size:
        return best_lo[:, 0], best_hi[:, 0]
    return best_lo, best_hi


def split_rows(qt: QuantizedTensor, sizes: list[int]) -> list[QuantizedTensor]:
    """Cut a weight quantized as one [sum(sizes), in] matrix back into its linears (rows are independent)."""
    parts = zip(qt.codes.split(sizes), qt.scale.split(sizes), qt.zero_point.split(sizes))
    return [QuantizedTensor(c, s, z, qt.bits, qt.axis, qt.group_size) for c, s, z in parts]
