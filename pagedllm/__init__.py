"""pagedllm: a readable LLM inference and serving engine with a paged KV cache."""

__version__ = "0.1.0"
