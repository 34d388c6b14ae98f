"""KV-cache arithmetic: how many bytes a token, a request and a block take, and how many fit.

Pure functions on exact integers. INT4 stores half a byte an element, so bytes-per-element are
Fractions; every result a function returns is a whole number of bytes (or an exact Fraction).
The formulas and the worked examples are in shared/spec/memory-and-quantization.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pagedllm.config import ModelConfig
from pagedllm.distributed.partition import head_shards, split
from pagedllm.errors import InputError

# p: bytes per stored element.
DTYPE_BYTES: dict[str, Fraction] = {
    "fp32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "int8": Fraction(1),
    "int4": Fraction(1, 2),
}
# Other spellings people type; they map onto the names above.
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
}


def dtype_name(dtype: str) -> str:
    """Canonical dtype name ("float16" -> "fp16"); unknown -> InputError listing the known ones."""
    name = str(dtype).strip().lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise InputError(f"dtype {dtype!r} is unknown; known: {', '.join(DTYPE_BYTES)}", param="dtype")
    return name


def dtype_bytes(dtype: str) -> Fraction:
    """Bytes per element p: fp16 -> 2, int4 -> 1/2."""
    return DTYPE_BYTES[dtype_name(dtype)]


def _positive(value: int, name: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, got {value!r}", param=name)
    if value < 0 or (value == 0 and not allow_zero):
        limit = ">= 0" if allow_zero else ">= 1"
        raise InputError(f"{name} must be {limit}, got {value}", param=name)
    return value


def kv_width(num_kv_heads: int, head_dim: int) -> int:
    """Width of one K (or V) vector per token and layer; d_model for plain multi-head attention."""
    return _positive(num_kv_heads, "num_kv_heads") * _positive(head_dim, "head_dim")


def kv_bytes_per_token(num_layers: int, kv_width: int, dtype: str = "fp16") -> int:
    """2 (K and V) * L * kv_width * p. Always whole: with p = 1/2 it is L * kv_width."""
    total = 2 * _positive(num_layers, "num_layers") * _positive(kv_width, "kv_width") * dtype_bytes(dtype)
    return int(total)


def kv_bytes(batch: int, seq_len: int, num_layers: int, kv_width: int, dtype: str = "fp16") -> int:
    """kv_bytes = 2 * B * S * L * kv_width * p: the cache of B requests of S tokens each."""
    b = _positive(batch, "batch")
    s = _positive(seq_len, "seq_len")
    return b * s * kv_bytes_per_token(num_layers, kv_width, dtype)


def block_bytes(block_size: int, bytes_per_token: int) -> int:
    """One block holds block_size tokens of every layer's K and V."""
    return _positive(block_size, "block_size") * _positive(bytes_per_token, "bytes_per_token")


def num_blocks_for(memory_bytes: int, block_size: int, bytes_per_token: Sequence[int]) -> int:
    """Blocks of block_size tokens that memory_bytes holds when every block keeps the K/V of each model.

    bytes_per_token is one entry per model sharing the pool: [target] alone, or [target, draft] for a
    speculative draft model, whose own paged cache has as many blocks of the same size as the target's
    (block i holds both models' K/V for the same tokens). So the budget is split:
    memory_bytes // (block_size * sum(bytes_per_token)).
    """
    if isinstance(bytes_per_token, (str, bytes)) or not isinstance(bytes_per_token, Sequence):
        raise InputError(
            f"bytes_per_token must be a sequence of whole numbers, got {bytes_per_token!r}",
            param="bytes_per_token",
        )
    if not bytes_per_token:
        raise InputError("bytes_per_token is empty: give one entry per model", param="bytes_per_token")
    memory = _positive(memory_bytes, "memory_bytes", allow_zero=True)
    per_token = sum(_positive(b, "bytes_per_token") for b in bytes_per_token)
    return memory // block_bytes(block_size, per_token)


def weight_bytes(num_params: int, dtype: str = "fp16") -> int:
    """Bytes of num_params weights stored as dtype; an odd INT4 count rounds up to a whole byte."""
    return math.ceil(_positive(num_params, "num_params") * dtype_bytes(dtype))


def param_count(config: ModelConfig) -> int:
    """Parameters of a Llama-family decoder (what the weights file holds).

    embeddings + per layer (q/k/v/o with grouped-query K/V, gate/up/down MLP, two RMSNorms)
    + final norm + lm_head (absent when tied to the embeddings). A mixture of experts counts every
    expert (all are resident, though each token runs only num_experts_per_tok of them) and the router.
    """
    d = config.hidden_size
    q_width = config.num_heads * config.head_dim
    kv = config.kv_width
    attn = d * q_width + 2 * d * kv + q_width * d
    if config.attention_bias:  # Qwen2: q/k/v have a bias, o does not
        attn += q_width + 2 * kv
    widths = (config.intermediate_size, config.moe_intermediate_size)
    mlps = sum(_mlp_params(config, i, *widths) for i in range(config.num_layers))
    norms = 2 * d
    per_layer = attn + norms
    embed = config.vocab_size * d
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * d
    return embed + config.num_layers * per_layer + mlps + d + lm_head


def _mlp_params(config: ModelConfig, layer: int, width: int, expert_width: int) -> int:
    """Layer `layer`'s MLP: gate/up/down of `width`, or a MoE layer's experts of `expert_width` each and
    its router (whole on every tensor-parallel rank)."""
    d = config.hidden_size
    if config.is_moe_layer(layer):
        return config.num_experts * (3 * d * expert_width + d)
    return 3 * d * width


@dataclass
class Capacity:
    """How many requests of per_request_bytes fit once weights and overhead are paid."""

    memory_bytes: int
    weight_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int  # memory - weights - overhead
    per_request_bytes: int
    max_concurrent: int  # floor(budget / per_request)
    leftover_bytes: int  # budget - max_concurrent * per_request: idle, too small for one more


def capacity(memory: int, per_request: int, weights: int = 0, overhead: int = 0) -> Capacity:
    """KV budget = memory - weights - overhead; users = floor(budget / per_request)."""
    memory = _positive(memory, "memory", allow_zero=True)
    weights = _positive(weights, "weights", allow_zero=True)
    overhead = _positive(overhead, "overhead", allow_zero=True)
    per_request = _positive(per_request, "per_request")
    budget = memory - weights - overhead
    if budget < 0:
        raise InputError(
            f"memory {memory} bytes is smaller than weights {weights} + overhead {overhead} bytes; "
            "nothing is left for the KV cache",
            param="memory",
        )
    users, leftover = divmod(budget, per_request)
    return Capacity(memory, weights, overhead, budget, per_request, users, leftover)


@dataclass
class Waste:
    """Slots one request holds but does not use: paged (whole blocks) vs naive (max_len reserved)."""

    seq_len: int
    block_size: int
    blocks_per_request: int  # ceil(seq_len / block_size)
    paged_slots: int  # blocks_per_request * block_size
    paged_waste_tokens: int  # paged_slots - seq_len, at most block_size - 1
    last_block_waste: Fraction  # unused share of the last block (15/16 for one token in a 16 block)
    max_len: int | None = None
    naive_waste_tokens: int | None = None  # max_len - seq_len
    ratio: Fraction | None = None  # naive / paged waste; None when either is unknown or paged is 0


def waste(max_len: int | None, block_size: int, seq_len: int) -> Waste:
    """Blocks and wasted slots of one request of seq_len tokens (max_len=None: paged side only)."""
    bs = _positive(block_size, "block_size")
    s = _positive(seq_len, "seq_len")
    blocks = -(-s // bs)  # ceil without floats
    slots = blocks * bs
    paged = slots - s
    last = Fraction(paged, bs)
    if max_len is None:
        return Waste(s, bs, blocks, slots, paged, last)
    m = _positive(max_len, "max_len")
    if s > m:
        raise InputError(f"seq_len {s} is longer than max_len {m}", param="seq_len")
    naive = m - s
    ratio = Fraction(naive, paged) if paged else None
    return Waste(s, bs, blocks, slots, paged, last, m, naive, ratio)


def param_count_per_rank(config: ModelConfig, tp_size: int) -> list[int]:
    """Parameters each of tp_size tensor-parallel ranks holds, split as pagedllm/distributed/partition.py
    says: q/k/v and o by the rank's heads (head_shards), gate/up/down by its part of the intermediate size
    and the embedding (and an untied lm_head) by its part of the vocabulary (split), the norms on every
    rank. KV heads replicated over ranks count on each of them, so the sum can exceed param_count."""
    d, hdim = config.hidden_size, config.head_dim
    mlp_parts = split(config.intermediate_size, tp_size)
    expert_parts = split(config.moe_intermediate_size, tp_size) if config.num_experts else [(0, 0)] * tp_size
    vocab_parts = split(config.vocab_size, tp_size)
    vocab_copies = 1 if config.tie_word_embeddings else 2  # embedding, and lm_head unless tied
    norms = config.num_layers * 2 * d + d  # two RMSNorms a layer and the final one, replicated
    counts = []
    for shard, (m0, m1), (e0, e1), (v0, v1) in zip(
        head_shards(config.num_heads, config.num_kv_heads, tp_size), mlp_parts, expert_parts, vocab_parts
    ):
        q, kv = shard.num_heads * hdim, shard.num_kv_heads * hdim
        attn = d * q + 2 * d * kv + q * d
        if config.attention_bias:
            attn += q + 2 * kv
        mlps = sum(_mlp_params(config, i, m1 - m0, e1 - e0) for i in range(config.num_layers))
        counts.append(config.num_layers * attn + mlps + norms + vocab_copies * (v1 - v0) * d)
    return counts
