"""The runner's own record of each request it runs, kept from step to step (vLLM v1's input batch idea).

A step (core/scheduler_output.py) sends a request whole once and then only what changed, so the runner,
in this process or in a tensor-parallel worker process, never reads the scheduler's live objects. The
record has the attributes the sampler reads (sampling_params, prompt_token_ids, output_token_ids,
generator, eos_token_ids), and survives preemption (its tokens and its seeded generator go on) until
the step that lists it as finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.request import token_ids_slice
from pagedllm.core.scheduler_output import NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        generator = None if new.seed is None else torch.Generator().manual_seed(new.seed)
        return cls(
            new.req_id,
            new.prompt_token_ids,
            new.output_token_ids,
            new.sampling_params,
            new.eos_token_ids,
            generator,
            new.block_ids,
            new.num_computed_tokens,
            new.lora_int_id,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output."""
        return token_ids_slice(self.prompt_token_ids, self.output_token_ids, start, end)


class InputBatch:
    """Every request state this runner holds, brought up to date by each step."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, step: SchedulerOutput) -> list[CachedRequestState]:
        """Apply a step's changes; returns the scheduled requests' states in scheduling order."""
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
        for new in step.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            state = CachedRequestState.from_new(new)
            if old is not None and old.generator is not None:
                state.generator = old.generator  # resent whole (a draft mirror): its random stream goes on
            self.requests[new.req_id] = state
        for cached in step.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.output_token_ids.extend(cached.new_token_ids)
            state.block_ids = cached.block_ids
            state.num_computed_tokens = cached.num_computed_tokens
        return [self.requests[rid] for rid in step.num_scheduled_tokens]
