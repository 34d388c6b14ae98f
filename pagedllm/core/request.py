"""Request: one sequence the scheduler tracks from arrival to finish (an n > 1 request is n siblings)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state (see is_finished).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        # Works both as RequestStatus.is_finished(status) (vLLM's spelling) and status.is_finished().
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def token_ids_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without concatenating the whole sequence (a decode step asks every
    running request for its one new token)."""
    p = len(prompt)
    if start >= p:
        return output[start - p : end - p]
    if end <= p:
        return prompt[start:end]
    return prompt[start:] + output[: end - p]


@dataclass(eq=False)  # identity equality: two requests with equal fields are still two requests
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)  # from the engine (tokenizer / model config)
    arrival_time: float = 0.0
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's meaning)
    group_id: str | None = None  # siblings of one n > 1 request share it; defaults to request_id
    index: int = 0  # 0..n-1 among the siblings
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)  # the block table: physical block ids in order
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    seed: int | None = None  # its sampling generator's seed, when sampling_params.seed is set (+ index)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # A StructuredOutputRequest (pagedllm.structured_output) when the output is constrained: the request is
    # scheduled once its grammar is compiled (is_ready), and its matcher follows output_token_ids.
    structured_output: Any = None
    # Draft tokens proposed for the next step (speculative decoding); the scheduler schedules them after
    # the last known token, and the step's verification decides which of them join output_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    # prompt tokens found computed at its first admission: prefix-cache hits plus blocks read from
    # --kv-offload-dir (usage.prompt_tokens_details.cached_tokens); -1 until admitted
    num_cached_tokens: int = -1
    # the LoRA adapter it runs with (pagedllm/lora), 0 for the base model: the runner's slot, the scheduler's
    # max_loras limit, and a key of its first block's prefix hash (two adapters never share KV)
    lora_int_id: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.group_id is None:
            self.group_id = self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return token_ids_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)
