"""What one step asks of the model runners: plain data (ids, block tables, sampling parameters), no live objects.

A runner keeps its own state of every request it has run (worker/input_batch.py), so a step carries a
request's whole data once (NewRequestData) and afterwards only what changed (CachedRequestData): the
tokens it gained, its block table, how many of its tokens the cache holds. Being plain data, a step can be
pickled to runner processes (tensor parallelism) as well as handed to the runner in this process.
`RunnerSync` remembers what the runner was already sent, on the scheduler's side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.request import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or whose state it must replace): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a resent request's outputs so far (empty for a fresh one)
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    seed: int | None  # its sampling generator's seed (n siblings: the request's seed + index)
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)


@dataclass
class CachedRequestData:
    """A request the runner holds: what changed since it was last scheduled."""

    req_id: str
    new_token_ids: list[int]  # tokens it gained (sampled by the last step; after a stop, cut there)
    # the whole table: copy-on-write replaces a block and a rejected draft's tail goes back, so a table
    # does not only grow
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens it feeds this step, in scheduling order
    total_num_scheduled_tokens: int
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    # request id -> the draft tokens it verifies this step (fed after its last known token)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # --kv-offload-dir (core/kv_offload.py), in this order before the forward: (block_id, hash) of evicted
    # cached blocks to copy out (the runner returns their bytes, the engine queues them for the disk), then
    # (block_id, bytes) of blocks read back from disk to copy in
    kv_blocks_to_save: list[tuple[int, int]] = field(default_factory=list)
    kv_blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def scheduled_req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)


class RunnerSync:
    """How many tokens of each request the runner holds, so that a step sends each token once.

    While a request lives its tokens only grow; when they are replaced (a draft model's mirror) the owner
    calls `forget` and the next step sends the request whole again."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}
        self._finished: set[str] = set()

    def finish(self, request_id: str) -> None:
        """The request is gone: the next step tells the runner to drop it (if it ever had it)."""
        if self._known.pop(request_id, None) is not None:
            self._finished.add(request_id)

    def forget(self, request_id: str) -> None:
        self._known.pop(request_id, None)

    def build(
        self,
        requests: Iterable[Request],
        num_scheduled_tokens: dict[str, int],
        blocks_to_copy: list[tuple[int, int]] | None = None,
        preempted_request_ids: list[str] | None = None,
        spec_decode_tokens: dict[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        new, cached = [], []
        for req in requests:
            rid = req.request_id
            known = self._known.get(rid)
            if known is None:
                new.append(
                    NewRequestData(
                        rid,
                        list(req.prompt_token_ids),
                        list(req.output_token_ids),
                        req.sampling_params,
                        list(req.eos_token_ids),
                        req.seed,
                        list(req.block_ids),
                        req.num_computed_tokens,
                        req.lora_int_id,
                    )
                )
            else:
                cached.append(
                    CachedRequestData(
                        rid,
                        req.token_ids_slice(known, req.num_tokens),
                        list(req.block_ids),
                        req.num_computed_tokens,
                    )
                )
            self._known[rid] = req.num_tokens
        finished, self._finished = self._finished, set()
        return SchedulerOutput(
            new,
            cached,
            num_scheduled_tokens,
            sum(num_scheduled_tokens.values()),
            blocks_to_copy or [],
            preempted_request_ids or [],
            finished,
            spec_decode_tokens or {},
        )
