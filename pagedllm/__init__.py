"""pagedllm: a readable LLM inference and serving engine with a paged KV cache."""

from pagedllm.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "__version__",
]


def __getattr__(name: str):
    # Lazy, so `pagedllm --help` and the planner start without importing torch.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from pagedllm import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    if name == "LoRARequest":
        from pagedllm.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
