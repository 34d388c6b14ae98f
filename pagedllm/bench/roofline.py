"""The memory-bandwidth roofline of single-stream decode: how close each system gets to this machine's limit.

At batch size one a decode step multiplies one row of activations by every weight matrix of the model, so
each weight byte is read from memory once for one token and does two flops' work: on a CPU the step is
bound by memory bandwidth, not arithmetic. The fastest any system can decode one stream is therefore

    roofline tok/s = read bandwidth (bytes/s) / bytes read per generated token

and `measured decode tok/s / roofline tok/s` says how much of the machine a system uses, whatever the
quantization of the weights (a Q4_0 file reads fewer bytes than a bf16 one, and both are judged against
their own roofline). The bytes per token counted here are the weights only: the KV cache a step also reads
is small at single50's lengths (a few MB against hundreds), and the token embedding is a lookup of one row.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a model is counted: rendering a report (report.py) needs none
    from torch import nn

# llama.cpp's names of a GGUF file's token embedding and lm_head
TOKEN_EMBD, OUTPUT = "token_embd.weight", "output.weight"
# a mixture of experts' expert tensors (all experts in one 3-D tensor a layer): `ffn_gate_exps` and the like;
# `_shexp` (shared experts) are read for every token and are not among them
EXPERTS_SUFFIX = "_exps.weight"


def model_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes a single-stream decode step of a built model reads: the decoder linears as the engine
    stores them (QuantLinear's blocks and kernel layout, a PackedLinear's oneDNN copy, a float Linear's
    weight), the norms and the lm_head; not the token embedding, of which a step reads one row. A tied lm_head
    reads the embedding's matrix, so it is counted (once) as the lm_head. Of a mixture of experts' block only
    the experts a token is routed to are read: num_experts_per_tok of num_experts, on average.

    QuantLinear.weight_bytes counts what is resident: exact for the amx and avx2 layouts and the torch
    reference, which keep one copy; torch's int4 fallback kernel keeps the stored codes beside its own
    layout and is over-counted by them."""
    from torch import nn

    from pagedllm.model.layers.moe import SparseMoeBlock
    from pagedllm.quantization.embedding import QuantEmbedding

    seen: set[int] = set()  # a parameter shared by two modules (a tied head) is read once

    def count(module: nn.Module) -> float:
        if isinstance(module, (nn.Embedding, QuantEmbedding)):  # a lookup of one row (a tied table: lm_head)
            return 0
        if isinstance(module, SparseMoeBlock):
            experts = sum(count(e) for e in module.experts)
            return count(module.gate) + experts * module.top_k / len(module.experts)
        if hasattr(module, "weight_bytes"):  # QuantLinear, PackedLinear: they know their own layout
            return module.weight_bytes()
        own = 0
        for p in module.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                own += p.numel() * p.element_size()
        return own + sum(count(child) for child in module.children())

    return round(count(model))


def gguf_decode_bytes(tensor_bytes: Mapping[str, int], active_expert_fraction: float = 1.0) -> int:
    """Bytes a single-stream decode step reads from a GGUF model, given each tensor's size in the file:
    every tensor but token_embd.weight (one row of it is gathered per token), unless the file has no
    output.weight: then the embeddings are tied, the lm_head multiplies by token_embd, and it is counted
    once. Expert tensors count with the share of experts a token is routed to (expert_used_count /
    expert_count)."""
    total = 0.0
    for name, n in tensor_bytes.items():
        if name == TOKEN_EMBD and OUTPUT in tensor_bytes:
            continue
        total += n * active_expert_fraction if name.endswith(EXPERTS_SUFFIX) else n
    return round(total)


def gguf_bytes_per_token(path: str | Path) -> int:
    """gguf_decode_bytes of a file, its tensor sizes as the gguf package reads them (llama.cpp's own
    sizes: the quantized blocks as stored)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    arch = _field(reader, "general.architecture")
    used, count = _field(reader, f"{arch}.expert_used_count"), _field(reader, f"{arch}.expert_count")
    return gguf_decode_bytes(sizes, used / count if used and count else 1.0)


def _field(reader, key: str):
    """A scalar or string key/value of a GGUF file, or None (parts/data: the reader API of every gguf version)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0].item()


def roofline_tokens_per_second(read_gbps: float, bytes_per_token: int) -> float:
    """The fastest single-stream decode this read bandwidth allows (GB/s = 1e9 bytes/s)."""
    return read_gbps * 1e9 / bytes_per_token


def percent_of_roofline(decode_tokens_per_second: float, read_gbps: float, bytes_per_token: int) -> float:
    """How much of the bandwidth roofline a measured single-stream decode reaches, in percent."""
    return 100.0 * decode_tokens_per_second / roofline_tokens_per_second(read_gbps, bytes_per_token)


def roofline_figures(row: Mapping, read_gbps: float | None) -> dict:
    """A system's bytes/token, roofline tok/s and % of roofline from its row of a throughput report (its
    decode_tokens_per_second and bytes_per_token); {} where either, or the bandwidth, is missing."""
    bytes_per_token, decode = row.get("bytes_per_token"), row.get("decode_tokens_per_second")
    if not (bytes_per_token and decode and read_gbps):
        return {}
    return {
        "bytes_per_token": bytes_per_token,
        "roofline_tokens_per_second": roofline_tokens_per_second(read_gbps, bytes_per_token),
        "percent_of_roofline": percent_of_roofline(decode, read_gbps, bytes_per_token),
    }


def format_roofline(report: Mapping, read_gbps: float, threads: int) -> str:
    """The CLI's lines: the bandwidth once, then each system's load time, bytes/token and, for a single
    stream (one request: a batch reads each weight once for many tokens), its roofline."""
    lines = [f"memory read bandwidth: {read_gbps:.1f} GB/s ({threads} threads, torch.sum over 512 MB)"]
    for name, row in report.items():
        if not isinstance(row, Mapping):
            continue
        parts = []
        if row.get("load_time_s") is not None:
            parts.append(f"load {row['load_time_s']:.1f} s")
        if row.get("bytes_per_token"):
            parts.append(f"{row['bytes_per_token'] / 1e6:.1f} MB read per token")
        if row.get("num_requests") == 1 and (fig := roofline_figures(row, read_gbps)):
            parts.append(
                f"roofline {fig['roofline_tokens_per_second']:.1f} tok/s, "
                f"decode at {fig['percent_of_roofline']:.0f}% of it"
            )
        if parts:
            lines.append(f"{name:>16}: " + ", ".join(parts))
    return "\n".join(lines)
