"""Prompt logprobs: for every prompt token after the first, its logprob under the model and the top-k
alternatives (SamplingParams.prompt_logprobs, vLLM's RequestOutput.prompt_logprobs).

Row p of a prefill chunk predicts prompt token p + 1, so a chunk covering positions [start, end) answers
tokens start + 1 .. end (never the one after the prompt: that row samples the first output token). The
logits are taken in the model's dtype and upcast to float32 before the softmax, ROWS_PER_SLICE rows at a
time, so that a long chunk never holds a [chunk, vocab] float32 tensor whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS_PER_SLICE = 256  # 256 x 49152 float32 = 48 MiB at a time


@dataclass
class PromptLogprobsSpan:
    """What a request asks of this step: rows [row, row + count) of the flat batch predict its prompt
    tokens first_index .. first_index + count - 1."""

    request_id: str
    row: int
    count: int
    first_index: int
    num_top: int


@dataclass
class PromptLogprobs:
    first_index: int  # the prompt index of token_ids[0]
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = the most likely token
    top: list[list[tuple[int, float]]]  # per token, num_top (token, logprob), most likely first


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, spans: list[PromptLogprobsSpan], prompts: dict[str, list[int]]
) -> dict[str, PromptLogprobs]:
    out = {}
    for span in spans:
        prompt = prompts[span.request_id]
        targets = torch.tensor(prompt[span.first_index : span.first_index + span.count], dtype=torch.long)
        logprobs: list[float] = []
        ranks: list[int] = []
        top: list[list[tuple[int, float]]] = []
        for s in range(0, span.count, ROWS_PER_SLICE):
            rows = hidden[span.row + s : span.row + min(span.count, s + ROWS_PER_SLICE)]
            logits = model.compute_logits(rows, upcast=False).float()
            # log p = logit - logsumexp: no [rows, vocab] log-softmax tensor written, ranks and top-k
            # read the logits themselves (the same order)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            t = targets[s : s + rows.shape[0], None]
            chosen = logits.gather(1, t)
            logprobs += (chosen - lse)[:, 0].tolist()
            ranks += ((logits > chosen).sum(dim=-1) + 1).tolist()
            if span.num_top:
                values, ids = logits.topk(span.num_top, dim=-1)
                top += [list(zip(i, v)) for i, v in zip(ids.tolist(), (values - lse).tolist())]
            else:
                top += [[] for _ in range(rows.shape[0])]
        out[span.request_id] = PromptLogprobs(span.first_index, targets.tolist(), logprobs, ranks, top)
    return out
