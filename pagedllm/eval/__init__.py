"""Model evaluation: perplexity on a text corpus (perplexity.py)."""

from pagedllm.eval.perplexity import PerplexityResult, perplexity, perplexity_windows

__all__ = ["PerplexityResult", "perplexity", "perplexity_windows"]
