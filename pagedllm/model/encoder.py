"""A bidirectional encoder: BERT and XLM-RoBERTa (the bge / e5 / MiniLM / multilingual embedders and their
cross-encoders), beside model/llama.py in the same registry (model/loader/registry.py, model_class
"EncoderModel").

The model sees one flat batch of T tokens from B whole inputs (no KV cache: an encoder reads its input
once and keeps nothing), as the decoder sees its steps. The linears run on the flat rows, so inputs of
different lengths cost no padding; attention runs per input over views of those rows (no padding, no
mask: a padded [B, longest] block cost 3x the attention work on a 16-300 token mix and 7% in copies).
Post-norm layers, as BERT: x = LN(x + attn(x)); x = LN(x + mlp(x)).

Ops go through the op table (ops.py): bf16 linears are prepacked for oneDNN where its "linear" backend is
"onednn-prepacked" (model/fuse.py's prepack), and attention is SDPA, or the eager formula where
"attention_prefill" runs the torch reference.

XLM-RoBERTa is this model with positions that start at pad_token_id + 1 (its embeddings skip the padding
index) and a two-layer classifier head; nothing else differs.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.errors import InputError
from pagedllm.model.fuse import prepack
from pagedllm.model.loader import registry
from pagedllm.model.loader.sentence_transformers import ENCODER_CLASS

# prefixes transformers puts before the encoder's weights in task models (BertForSequenceClassification)
WEIGHT_PREFIXES = ("bert.", "roberta.", "model.")
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # the registry's name: "bert" or "xlm-roberta"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int  # XLM-R: positions start at pad_token_id + 1; BERT: 0
    num_labels: int  # a *ForSequenceClassification head's outputs; 0 = no head (an embedder)

    @property
    def max_model_len(self) -> int:
        """The longest input the position table covers."""
        return self.max_position_embeddings - self.position_offset


def read_encoder_config(folder: Path) -> EncoderConfig:
    file = folder / "config.json"
    cfg = json.loads(file.read_text())
    entry = registry.from_hf(registry.hf_architecture_name(cfg), str(file))
    if entry.model_class != ENCODER_CLASS:
        raise InputError(f"{file}: {entry.name} is not an encoder", param="model")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise InputError(f"{file}: position_embedding_type {kind!r} is not supported (absolute)", "model")
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise InputError(f"{file}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})", "model")
    archs = cfg.get("architectures") or []
    classifier = bool(archs) and archs[0].endswith("ForSequenceClassification")
    labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1) if classifier else 0
    pad = int(cfg.get("pad_token_id") or 0)
    return EncoderConfig(
        architecture=entry.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]),
        hidden_act=act,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        position_offset=pad + 1 if entry.name == "xlm-roberta" else 0,
        num_labels=labels,
    )


@dataclass
class EncoderBatch:
    """B whole inputs as one flat batch."""

    input_ids: torch.Tensor  # [T] long
    token_type_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, from 0 in each input
    seq_lens: list[int]
    starts: list[int]  # [B + 1] each input's first row, and T

    @classmethod
    def build(cls, inputs: list[list[int]], token_types: list[list[int] | None]) -> EncoderBatch:
        lens = [len(ids) for ids in inputs]
        types = [t if t is not None else [0] * n for t, n in zip(token_types, lens)]
        return cls(
            torch.tensor([i for ids in inputs for i in ids], dtype=torch.long),
            torch.tensor([t for ts in types for t in ts], dtype=torch.long),
            torch.cat([torch.arange(n) for n in lens]),
            lens,
            [0, *itertools.accumulate(lens)],
        )


class EncoderAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        d = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, d // config.num_heads
        self.qkv = nn.Linear(d, 3 * d)  # the checkpoint's query / key / value, merged at load
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        t, d = x.shape
        qkv = self.qkv(x).view(t, 3, self.num_heads, self.head_dim)
        o = torch.empty_like(x).view(t, self.num_heads, self.head_dim)
        # each input attends to its own rows only: views of the flat batch, no padding and no mask
        # (one call per input, as attention/paged.py's prefill; the linears above and below take them all)
        for start, end in itertools.pairwise(batch.starts):
            q, k, v = (qkv[start:end, i].transpose(0, 1).unsqueeze(0) for i in range(3))  # [1, H, n, hd]
            out = attend(q, k, v)[0]
            # head by head: one transposing copy_ of the whole [H, n, hd] goes through torch's parallel
            # copy, measured at 8 ms against 0.06 ms for these twelve on 2 busy cores (300 tokens, bf16)
            for h in range(self.num_heads):
                o[start:end, h].copy_(out[h])
        return self.norm(x + self.dense(o.view(t, d)))


def attend(q, k, v) -> torch.Tensor:
    """Bidirectional attention over one input: SDPA, or the eager formula (the reference)."""
    if ops.backend("attention_prefill") != ops.REFERENCE:
        return F.scaled_dot_product_attention(q, k, v)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.attention = EncoderAttention(config)
        self.intermediate = nn.Linear(d, f)
        self.output = nn.Linear(f, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.norm(x + self.output(self.act(self.intermediate(x))))


class ClassifierHead(nn.Module):
    """A *ForSequenceClassification head over each input's first token: BERT's pooler (dense + tanh) then
    a linear; XLM-R's dense + tanh + out_proj. The same two matmuls under two checkpoint layouts."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_tokens)))


class EncoderModel(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, d)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, d)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, d)
        self.embed_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.classifier = ClassifierHead(config) if config.num_labels else None

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """The last layer's hidden states, [T, hidden], one row per token of the flat batch."""
        x = (
            self.word_embeddings(batch.input_ids)
            + self.position_embeddings(batch.positions + self.config.position_offset)
            + self.token_type_embeddings(batch.token_type_ids)
        )
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """The classifier head's logits [B, num_labels] (float32) over each input's first token."""
        starts = torch.tensor([0, *seq_lens[:-1]]).cumsum(0)
        return self.classifier(hidden.index_select(0, starts)).float()

    @classmethod
    def from_weights(
        cls, config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> EncoderModel:
        """Build without random initialisation, load the checkpoint's tensors (transformers' names), merge
        q/k/v, and prepack the linears where the op table says (inference only from here on)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device="cpu")
        params = dict(model.named_parameters())
        loaded = _our_names(config, weights)
        missing = sorted(set(params) - set(loaded))
        if missing:
            raise InputError(f"checkpoint lacks {len(missing)} encoder weights, e.g. {missing[:3]}", "model")
        with torch.no_grad():
            for name, tensor in loaded.items():
                if name in params:
                    if params[name].shape != tensor.shape:
                        raise InputError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(params[name].shape)}",
                            param="model",
                        )
                    params[name].copy_(tensor)
        model = model.to(dtype).eval()
        if ops.backend("linear") == "onednn-prepacked":
            for module in list(model.modules()):
                for child_name, child in list(module.named_children()):
                    if type(child) is nn.Linear:
                        setattr(module, child_name, prepack(child))
        return model


def _our_names(config: EncoderConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' BERT / XLM-R tensor names -> this module's (q/k/v concatenated into qkv)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        for prefix in WEIGHT_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        out[name] = tensor
    renames = {
        "embeddings.LayerNorm.": "embed_norm.",
        "encoder.layer.": "layers.",
        ".attention.output.dense.": ".attention.dense.",
        ".attention.output.LayerNorm.": ".attention.norm.",
        ".intermediate.dense.": ".intermediate.",
        ".output.dense.": ".output.",
        ".output.LayerNorm.": ".norm.",
        # BERT's pooler and classifier; XLM-R's classifier.dense and classifier.out_proj
        "pooler.dense.": "classifier.dense.",
        "classifier.out_proj.": "classifier.out.",
    }
    if config.num_labels and config.architecture == "bert":
        renames["classifier.weight"] = "classifier.out.weight"
        renames["classifier.bias"] = "classifier.out.bias"
    mapped = {}
    for name, tensor in out.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        name = name.removeprefix("embeddings.")  # embeddings.word_embeddings.weight -> word_embeddings.weight
        mapped[name] = tensor
    for i in range(config.num_layers):
        p = f"layers.{i}.attention."
        parts = [
            mapped.pop(f"{p}self.{x}.{k}", None)
            for k in ("weight", "bias")
            for x in ("query", "key", "value")
        ]
        if all(t is not None for t in parts):
            mapped[f"{p}qkv.weight"] = torch.cat(parts[:3])
            mapped[f"{p}qkv.bias"] = torch.cat(parts[3:])
    return mapped
