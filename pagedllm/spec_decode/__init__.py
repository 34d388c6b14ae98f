"""Speculative decoding: proposers of draft tokens (ngram.py, draft_model.py) and their statistics.

A proposer guesses the next few tokens of each running request; the model verifies them all in one step
(worker/rejection_sampler.py), so one read of the weights can yield several tokens.
"""

from pagedllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["SpecDecodingStats"]
