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
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # filled in at start-up from kv_cache_memory or num_kv_blocks
    kv_cache_dtype: str = "auto"  # auto = the model's compute dtype
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
