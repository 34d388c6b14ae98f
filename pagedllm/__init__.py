"""pagedllm: a readable LLM inference and serving engine with a paged KV cache."""

from pagedllm.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # Lazy, so `pagedllm --help` and the planner start without importing torch.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
