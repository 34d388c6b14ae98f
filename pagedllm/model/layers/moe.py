"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE, OLMoE): a router and num_experts gated MLPs.

Each token goes through the num_experts_per_tok experts its router scores highest, and the block's output
is their outputs weighted by the router's probabilities. The families share the routing and differ only
in the normalisation of the kept probabilities (`route`):
    Mixtral     softmax over all experts, top-k, renormalised to sum to 1 (always)
    Qwen3-MoE   softmax, top-k, renormalised iff config norm_topk_prob (True in the released models)
    OLMoE       softmax, top-k, norm_topk_prob (False in the released models: the kept share is used as is)

The experts run batched by expert (`experts_forward`): the (token, expert) pairs of a step are sorted by
expert, so each expert that got any rows runs one matmul chain over all of them at once, and the weighted
rows are added back to their tokens with one index_add. A step's cost is then one call per active expert,
not per token, and an expert nobody chose costs nothing. The experts are the model's own gated MLPs
(LlamaMLP, each a few nn.Linear), so RTN, GGUF blocks, fuse.py's gate/up merge, quantized folders and
tensor parallelism treat them as they treat any other linear.

Tensor parallelism: each expert holds its slice of moe_intermediate_size (its gate/up rows and down
columns), like a dense MLP's; the partial sums of every expert add up in the one all-reduce at the end.
The router is whole on every rank, so every rank picks the same experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import all_reduce


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids [T, k]): the softmax over every expert (in float32, as the
    reference implementations do), its k largest entries, and those rescaled to sum to 1 if asked."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """sum over k of weights[t, k] * experts[ids[t, k]](x[t]) for every token t, batched by expert.

    x [T, D]; weights [T, k] float32; ids [T, k]. The T*k (token, expert) pairs are sorted by expert
    (stable, so each expert's rows keep token order), each expert with rows runs once over its block of
    gathered rows, and the weighted results are scattered back onto their tokens in float32."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k  # the token each sorted pair belongs to
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host sync a layer
    rows = x[token]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    scale = weights.reshape(-1)[order].unsqueeze(-1)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            end = start + n
            out.index_add_(0, token[start:end], expert(rows[start:end]).float() * scale[start:end])
            start = end
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, [num_experts, hidden], no bias) and `experts`, built by `make_expert` (the model's
    gated MLP of moe_intermediate_size, without its own all-reduce: the block reduces once)."""

    def __init__(self, config: ModelConfig, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return all_reduce(experts_forward(x, weights, ids, self.experts))
