"""The model families pagedllm runs: one entry per architecture, and the config keys none of them implement.

Each entry names the architecture three ways (the `ModelConfig.architecture` tag, the Hugging Face
`architectures[0]` class name and `model_type`, and llama.cpp's `general.architecture`), the class that
builds it, and the features that set it apart from plain Llama. The loaders (hf_config.py, gguf.py), the
quantized-folder writer and reader (model/quantized_checkpoint.py), the GGUF-native linears and
model/build.py ask here; adding a family is one entry (and its feature in model/llama.py if it is new).
It lives with the loaders because they are its lowest users (tests/test_layering.py: model/ and
quantization/ may import from the loader package, not the other way round); plain data, no torch.

A checkpoint whose architecture has no entry, or whose config turns on a feature nothing here implements
(a MoE block, logit soft-capping, partial rotary, a q/k norm on a family without one; shared experts or
grouped routing on any), is refused with one InputError line naming the architecture or the key: it is
never run as Llama and silently diverges.

Sliding-window attention: which layers a config's `sliding_window` applies to is the family's rule
(`sliding_layers`, as transformers applies it), unless config.json lists `layer_types` and the family
reads them. Mistral and Phi-3 window every layer; Qwen2/3 the layers from max_window_layers on, and only
with use_sliding_window; Gemma 2 every other layer, Gemma 3 five of every six.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InputError


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json "architectures"[0]; the first is written back
    hf_model_type: str  # config.json "model_type", used when "architectures" is absent
    gguf_architecture: str | None  # a GGUF file's general.architecture; None: no GGUF files
    model_class: str = "LlamaForCausalLM"  # the class in model/ that builds it (model/classes.py's MODEL_CLASSES)
    qkv_bias: bool = False  # q/k/v always have a bias (Qwen2); otherwise config attention_bias decides
    o_bias_with_attention_bias: bool = True  # config attention_bias covers o_proj too (Llama, Qwen3)
    qk_norm: bool = False  # an RMSNorm over each head's q and k, before rotary (Qwen3)
    gguf_permuted_qk: bool = False  # convert_hf_to_gguf permutes Q/K rows (the llama arch only)
    # which layers config.json's sliding_window applies to, where it lists no layer_types: "none" (Llama
    # ignores the key), "all" (layer_types ignored too, as transformers does), "max_window_layers" (Qwen:
    # with use_sliding_window, layers max_window_layers..), "pattern" (every sliding_window_pattern-th
    # layer global, the rest windowed: Gemma 2's 2, Gemma 3's 6 unless the config says)
    sliding_layers: str = "none"
    sliding_window_pattern: int = 0  # the "pattern" default
    # Gemma 2/3: (1 + weight) RMSNorms before and after each sublayer, embeddings scaled by sqrt(hidden),
    # tanh-GELU GeGLU, an attention scale from query_pre_attn_scalar, soft-capping where configured
    gemma: bool = False
    local_rope_base: bool = False  # Gemma 3: the sliding layers' own RoPE base (rope_local_base_freq)
    tie_word_embeddings_default: bool = False  # when config.json leaves tie_word_embeddings out
    # checkpoints store q/k/v as one qkv_proj ([q; k; v] rows) and gate/up as one gate_up_proj ([gate; up]
    # rows), GGUF as attn_qkv and ffn_up (Phi-3): split at load into the usual names
    fused_qkv_gate_up: bool = False
    partial_rotary: bool = False  # partial_rotary_factor < 1 allowed (rotary over each head's first dims)
    # mixture of experts (model/layers/moe.py, model/loader/moe.py): num_experts > 0 allowed. moe_norm_topk:
    # whether the kept top-k router probabilities are renormalised to sum to 1: "always" (Mixtral), or
    # "config" (config.json's norm_topk_prob, transformers' default False); gguf_moe_norm_topk is llama.cpp's
    # rule for the family's GGUF files (unless a file says {arch}.expert_weights_norm)
    moe: bool = False
    moe_norm_topk: str = "config"
    gguf_moe_norm_topk: bool = True
    moe_dense_layers: bool = False  # Qwen3-MoE: mlp_only_layers / decoder_sparse_step name dense layers
    qk_norm_full: bool = False  # OLMoE: the q/k norms span the whole projection, not each head
    clip_qkv: bool = False  # OLMoE: config.json's clip_qkv clamps q, k and v

    @property
    def features(self) -> tuple[str, ...]:
        """What the family has beyond a plain Llama decoder, for messages and `pagedllm env`-like listings."""
        named = {
            "q/k/v bias": self.qkv_bias,
            "q/k norm": self.qk_norm,
            "fused qkv/gate_up storage": self.fused_qkv_gate_up,
            "partial rotary": self.partial_rotary,
            "sliding window": self.sliding_layers != "none",
            "Gemma norms, GeGLU and soft-capping": self.gemma,
            "local RoPE base": self.local_rope_base,
            "mixture of experts": self.moe,
            "dense layers among the sparse": self.moe_dense_layers,
            "q/k norm over the whole projection": self.qk_norm_full,
            "clip_qkv": self.clip_qkv,
        }
        return tuple(k for k, v in named.items() if v)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM", "LlamaModel"), "llama", "llama", gguf_permuted_qk=True),
    # llama.cpp writes Mistral (7B v0.1-v0.3) files as arch "llama": they load as llama
    Architecture("mistral", ("MistralForCausalLM",), "mistral", None, sliding_layers="all"),
    Architecture(
        "qwen2",
        ("Qwen2ForCausalLM", "Qwen2Model"),  # Qwen2Model: gte-Qwen2 embedders
        "qwen2",
        "qwen2",
        qkv_bias=True,
        o_bias_with_attention_bias=False,
        sliding_layers="max_window_layers",
    ),
    Architecture(
        "qwen3",
        ("Qwen3ForCausalLM", "Qwen3Model"),  # Qwen3Model: the base model an embedder folder saves
        "qwen3",
        "qwen3",
        qk_norm=True,
        sliding_layers="max_window_layers",
    ),
    # Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder with fused storage, partial rotary (Phi-4-mini 0.75) and
    # LongRoPE (model/layers/rotary.py); transformers uses a configured sliding_window unconditionally
    Architecture(
        "phi3",
        ("Phi3ForCausalLM",),
        "phi3",
        "phi3",
        fused_qkv_gate_up=True,
        partial_rotary=True,
        sliding_layers="all",
    ),
    Architecture(
        "gemma2",
        ("Gemma2ForCausalLM",),
        "gemma2",
        "gemma2",
        sliding_layers="pattern",
        sliding_window_pattern=2,
        gemma=True,
        tie_word_embeddings_default=True,
    ),
    # the text model (Gemma 3 1B, or the language half of 4B-27B saved as Gemma3ForCausalLM)
    Architecture(
        "gemma3",
        ("Gemma3ForCausalLM",),
        "gemma3_text",
        "gemma3",
        qk_norm=True,
        sliding_layers="pattern",
        sliding_window_pattern=6,
        gemma=True,
        local_rope_base=True,
        tie_word_embeddings_default=True,
    ),
    # mixtures of experts. llama.cpp writes Mixtral as arch "llama" with llama.expert_count (from_gguf)
    Architecture(
        "mixtral",
        ("MixtralForCausalLM",),
        "mixtral",
        "llama",
        gguf_permuted_qk=True,
        sliding_layers="all",
        moe=True,
        moe_norm_topk="always",
    ),
    # Qwen3-MoE windows every layer only with use_sliding_window, which model/loader/moe.py refuses
    Architecture(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        "qwen3_moe",
        "qwen3moe",
        qk_norm=True,
        moe=True,
        moe_dense_layers=True,
    ),
    Architecture(
        "olmoe",
        ("OlmoeForCausalLM",),
        "olmoe",
        "olmoe",
        qk_norm=True,
        qk_norm_full=True,
        clip_qkv=True,
        moe=True,
        gguf_moe_norm_topk=False,
    ),
)

# encoders (model/encoder.py): pooling models only, served by the pooling engine (embeddings, scores)
ENCODER_ARCHITECTURES = (
    Architecture("bert", ("BertModel", "BertForSequenceClassification"), "bert", None, "EncoderModel"),
    Architecture(
        "xlm-roberta",
        ("XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel"),
        "xlm-roberta",
        None,
        "EncoderModel",
    ),
)
ARCHITECTURES += ENCODER_ARCHITECTURES

_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_HF = {hf: a for a in ARCHITECTURES for hf in a.hf_architectures}
_BY_MODEL_TYPE = {a.hf_model_type: a for a in ARCHITECTURES}
_BY_GGUF: dict[str, Architecture] = {}
for _a in ARCHITECTURES:
    if _a.gguf_architecture:
        _BY_GGUF.setdefault(_a.gguf_architecture, _a)  # the first entry of an arch owns it (llama)
# a MoE family whose GGUF files share a dense family's arch: told apart by {arch}.expert_count (Mixtral)
_GGUF_MOE_VARIANTS = {
    a.gguf_architecture: a for a in ARCHITECTURES if a.moe and _BY_GGUF[a.gguf_architecture] is not a
}


def get(name: str) -> Architecture:
    """The entry of a ModelConfig.architecture tag."""
    if name not in _BY_NAME:
        raise InputError(
            f"unsupported architecture {name!r} (supported: {', '.join(_BY_NAME)})", param="model"
        )
    return _BY_NAME[name]


def hf_architecture_name(cfg: dict[str, Any]) -> str | None:
    """config.json's architectures[0], or the class its model_type stands for (or the model_type itself)."""
    archs = cfg.get("architectures")
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    entry = _BY_MODEL_TYPE.get(model_type)
    return entry.hf_architectures[0] if entry else model_type


def from_hf(arch: str | None, where: str) -> Architecture:
    if arch not in _BY_HF:
        raise InputError(
            f"{where}: unsupported architecture {arch!r} (supported: {', '.join(_BY_HF)})", param="model"
        )
    return _BY_HF[arch]


def from_gguf(arch: str | None, where: str, meta: dict[str, Any] | None = None) -> Architecture:
    """The entry of a GGUF file's general.architecture; with its metadata, an arch llama.cpp shares between
    a dense family and a MoE one (llama: Llama and Mixtral) goes by {arch}.expert_count."""
    if arch not in _BY_GGUF:
        raise InputError(
            f"GGUF file {where}: unsupported architecture {arch!r} (supported: {', '.join(_BY_GGUF)})",
            param="model",
        )
    if meta is not None and arch in _GGUF_MOE_VARIANTS and _on(meta.get(f"{arch}.expert_count")):
        return _GGUF_MOE_VARIANTS[arch]
    return _BY_GGUF[arch]


def _on(value: Any) -> bool:
    """A config value that turns a feature on (absent, null, 0, false and [] do not)."""
    return value not in (None, 0, False, [], {})


# config.json keys that turn on a feature -> (what it is, the Architecture flag of the families that implement
# it, or None where none does). In this order a config with several is refused naming the first.
_HF_FEATURE_KEYS: dict[str, tuple[str, str | None]] = {
    "use_bidirectional_attention": ("bidirectional attention (an embedding model)", None),
    "n_routed_experts": ("a DeepSeek-style mixture-of-experts block", None),
    "shared_expert_intermediate_size": ("a shared expert", None),
    "n_shared_experts": ("shared experts", None),
    "num_shared_experts": ("shared experts", None),
    "n_group": ("grouped top-k routing", None),
    "topk_group": ("grouped top-k routing", None),
    "topk_method": ("another top-k routing method (e.g. a router bias)", None),
    "scoring_func": ("another router scoring function", None),
    "routed_scaling_factor": ("scaled routing weights", None),
    "first_k_dense_replace": ("leading dense layers (DeepSeek's)", None),
    "moe_layer_freq": ("a MoE layer frequency", None),
    "use_qk_norm": ("a q/k norm", "qk_norm"),
    "qk_layernorm": ("a q/k norm", "qk_norm"),
    "mlp_bias": ("MLP biases", None),
    "attn_logit_softcapping": ("attention logit soft-capping", "gemma"),
    "final_logit_softcapping": ("final logit soft-capping", "gemma"),
    "query_pre_attn_scalar": ("a non-default attention scale", "gemma"),
    "num_experts": ("a mixture-of-experts block", "moe"),
    "num_local_experts": ("a mixture-of-experts block", "moe"),
    "moe_intermediate_size": ("a mixture-of-experts block", "moe"),
    "clip_qkv": ("clipped q/k/v", "clip_qkv"),
    "mlp_only_layers": ("dense layers in a mixture of experts", "moe_dense_layers"),
}
# values of those keys that ask for what every MoE family here does (the plain softmax top-k router)
_HF_DEFAULT_VALUES = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "routed_scaling_factor": (1,)}


def check_hf_features(entry: Architecture, cfg: dict[str, Any], where: str) -> None:
    """Refuse a config.json that asks for something `entry` does not implement: one line naming the key."""
    arch = entry.hf_architectures[0]
    for key, (what, implemented_by) in _HF_FEATURE_KEYS.items():
        value = cfg.get(key)
        if not _on(value) or value in _HF_DEFAULT_VALUES.get(key, ()):
            continue
        if implemented_by is None or not getattr(entry, implemented_by):
            raise InputError(f"{where}: {key}={value!r} ({what}) is not supported for {arch}", param="model")
    act = hidden_act(cfg)
    allowed = ("gelu_pytorch_tanh",) if entry.gemma else ("silu",)
    if act not in allowed:
        raise InputError(
            f"{where}: unsupported hidden_act {act!r} for {arch} (supported: {', '.join(allowed)})",
            param="model",
        )
    prf = partial_rotary_factor(cfg)
    if prf != 1.0 and not entry.partial_rotary:
        raise InputError(
            f"{where}: partial_rotary_factor={prf!r} (rotary over part of each head) is not supported "
            f"for {arch}",
            param="model",
        )


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """config.json's partial_rotary_factor (top level, or in transformers 5's rope_parameters), 1.0 if absent."""
    prf = cfg.get("partial_rotary_factor")
    if prf is None:
        prf = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    return 1.0 if prf is None else float(prf)


def hidden_act(cfg: dict[str, Any]) -> str:
    """The MLP's activation: Gemma configs name it hidden_activation (their hidden_act may be stale)."""
    return cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"


LAYER_TYPES = ("full_attention", "sliding_attention")


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every pattern-th layer global, the others windowed (transformers' Gemma rule)."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def sliding_window_layers(
    entry: Architecture, cfg: dict[str, Any], num_layers: int, max_pos: int, where: str
) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of a config.json by the family's rule (module docstring); (None, None)
    where no layer is windowed or the window never slides (as wide as the context: plain attention)."""
    window = cfg.get("sliding_window")
    if entry.sliding_layers == "none" or not window:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InputError(f"{where}: sliding_window must be a positive integer; got {window!r}", param="model")
    types = cfg.get("layer_types")
    if entry.sliding_layers == "all":
        types = None  # transformers windows every layer of these families, whatever layer_types says
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
            raise InputError(
                f"{where}: layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}", param="model"
            )
    elif entry.sliding_layers == "all":
        types = ["sliding_attention"] * num_layers
    elif entry.sliding_layers == "max_window_layers":
        first = cfg.get("max_window_layers", 28) if cfg.get("use_sliding_window") else num_layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:
        pattern = int(cfg.get("sliding_window_pattern") or entry.sliding_window_pattern)
        types = pattern_layer_types(num_layers, pattern)
    if "sliding_attention" not in types or window >= max_pos:
        return None, None
    return window, list(types)


# GGUF metadata keys (after "<arch>.") that turn on a feature -> as _HF_FEATURE_KEYS
_GGUF_FEATURE_KEYS: dict[str, tuple[str, str | None]] = {
    "expert_count": ("a mixture-of-experts block", "moe"),
    "expert_shared_count": ("shared experts", None),
    "expert_shared_feed_forward_length": ("a shared expert", None),
    "expert_group_count": ("grouped top-k routing", None),
    "expert_group_used_count": ("grouped top-k routing", None),
    "leading_dense_block_count": ("leading dense layers (DeepSeek's)", None),
    "attn_logit_softcapping": ("attention logit soft-capping", "gemma"),
    "final_logit_softcapping": ("final logit soft-capping", "gemma"),
}


def check_gguf_features(entry: Architecture, meta: dict[str, Any], where: str) -> None:
    arch = entry.gguf_architecture
    for key, (what, implemented_by) in _GGUF_FEATURE_KEYS.items():
        value = meta.get(f"{arch}.{key}")
        if _on(value) and (implemented_by is None or not getattr(entry, implemented_by)):
            raise InputError(
                f"GGUF file {where}: {arch}.{key}={value!r} ({what}) is not supported for {arch}",
                param="model",
            )


# llama.cpp tensor names -> HF names; per-layer ones are matched on the part after "blk.N.". One table for
# every family: a family without a tensor simply has none in its files.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # fused (Phi-3); ffn_up holds [gate; up] there, split at load
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router, and the experts' gate/up/down stacked [experts, out, in] (split by loader/moe.py)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, which Gemma calls
# pre_feedforward_layernorm (post_attention_layernorm norms the attention's output there)
GGUF_GEMMA_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_layer_names(entry: Architecture) -> dict[str, str]:
    return GGUF_GEMMA_LAYER_NAMES if entry.gemma else GGUF_LAYER_NAMES
