"""Plain dataclasses that describe the model's shape, the KV cache and the scheduler's limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder, read from config.json or GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v have a bias (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False  # o_proj has a bias (Llama and Qwen3 with attention_bias; never Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before rotary (Qwen3)
    # rotary over the first rotary_dim dims of each head, the rest passed through (Phi-4-mini's
    # partial_rotary_factor 0.75); None = the whole head
    rotary_dim: int | None = None
    # sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p in the layers
    # layer_types marks "sliding_attention" (HF's names; None or absent = every layer "full_attention")
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling there)
    # Gemma 2/3 (registry "gemma" features): GeGLU, RMSNorm over (1 + weight) in float32, a norm after
    # each sublayer too (pre/post feedforward), embeddings times sqrt(hidden_size), soft-capped logits
    hidden_act: str = "silu"  # "silu" or "gelu_pytorch_tanh"
    gemma_norms: bool = False
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap), before the softmax
    final_logit_softcapping: float | None = None  # logits likewise
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    # mixture of experts (Mixtral, Qwen3-MoE, OLMoE; model/layers/moe.py): with num_experts > 0 every layer
    # but dense_layers has, instead of one MLP, num_experts MLPs of moe_intermediate_size each and a router
    # that sends each token to the num_experts_per_tok of them it scores highest (softmax over all experts,
    # the top k kept, renormalised to sum to 1 where norm_topk_prob). dense_layers' MLP is intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: list[int] = field(default_factory=list)  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step
    qk_norm_full: bool = False  # OLMoE: q_norm / k_norm over the whole q / k projection, not each head
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv] (after the q/k norms)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    def is_sliding(self, layer_idx: int) -> bool:
        return self.sliding_window is not None and bool(self.layer_types) and (
            self.layer_types[layer_idx] == "sliding_attention"
        )

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer windowed: a block wholly before the window is never read again and can be freed."""
        return all(self.is_sliding(i) for i in range(self.num_layers))

    @property
    def rotary_width(self) -> int:
        """The dims of each head that rotary turns (head_dim unless partial)."""
        return self.rotary_dim or self.head_dim


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # filled in at start-up from kv_cache_memory or num_kv_blocks
    kv_cache_dtype: str = "auto"  # auto = the model's compute dtype
    enable_prefix_caching: bool = True
    # every layer attends over a sliding window this wide: blocks wholly before it are freed as a request
    # moves on (None when any layer is global: that layer still reads them)
    sliding_window: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # or "priority" (core/request_queue.py)


SPECULATIVE_METHODS = ("ngram", "draft_model")
DRAFT_BUDGETS = ("measured", "off")
MAX_SPECULATIVE_TOKENS = 16  # verify rows per request a step; beyond this acceptance decays to nothing


@dataclass
class SpeculativeConfig:
    """--speculative-config, with vLLM's field names. ngram proposes from the request's own tokens (prompt
    lookup); draft_model runs a second, smaller model with the same vocabulary (`model`, `quantization`)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix of the sequence searched for earlier in it
    prompt_lookup_max: int = 5  # ngram: longest, tried first
    model: str | None = None  # draft_model: a GGUF file, a safetensors folder or 'default'
    quantization: str | None = None  # draft_model: as --quantization, for the draft (None = auto)
    # pagedllm's own field: "measured" verifies only the drafts that pay for their rows at this machine's
    # measured step cost (spec_decode/budget.py); "off" verifies every proposal, as vLLM does
    draft_budget: str = "measured"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the CLI flag); InputError naming the field on anything wrong,
        an unknown field included (refused, never ignored)."""
        import json
        from dataclasses import fields

        from pagedllm.errors import InputError

        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InputError(f"speculative_config is not JSON: {e}", "speculative_config") from e
        if not isinstance(value, dict):
            raise InputError("speculative_config must be a JSON object", "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InputError(
                f"speculative_config has unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})",
                f"speculative_config.{unknown[0]}",
            )
        value = dict(value)
        if "method" not in value:  # vLLM infers the method from a draft model's presence
            value["method"] = "draft_model" if value.get("model") else None
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        from pagedllm.errors import InputError

        def bad(field: str, message: str) -> InputError:
            return InputError(f"speculative_config.{field} {message}", f"speculative_config.{field}")

        if self.method not in SPECULATIVE_METHODS:
            raise bad("method", f"must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, f"must be an integer of at least 1; got {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be at most {MAX_SPECULATIVE_TOKENS}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise bad("prompt_lookup_max", f"must be at least prompt_lookup_min ({self.prompt_lookup_min})")
        if self.draft_budget not in DRAFT_BUDGETS:
            raise bad("draft_budget", f"must be one of {', '.join(DRAFT_BUDGETS)}; got {self.draft_budget!r}")
        if self.method == "draft_model" and not self.model:
            raise bad("model", "is required for method draft_model (a GGUF file, a folder or 'default')")
        if self.method == "ngram":
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise bad(name, "is for method draft_model; ngram proposes from the request's own tokens")
