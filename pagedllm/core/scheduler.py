"""Scheduler: each step picks which requests run and how many tokens each feeds (vLLM v1 policy).

One token budget per step is shared by decodes (1 token each, or 1 + its draft tokens when it
speculates) and prefill chunks, running requests first. When blocks run out, a request's draft tokens
go first; then the newest running request is preempted (its KV dropped; it later recomputes prompt +
output so far). Waiting requests are then admitted first come, first served.

--scheduling-policy priority (vLLM's): requests rank by (priority, arrival), lower first. The waiting queue
is served in rank order, the lowest-ranked running request is the one preempted when blocks run out, and a
waiting request that finds no free slot or blocks preempts the lowest-ranked running request when that one
ranks below it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.kv_offload import KVOffloadStore
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import make_request_queue
from pagedllm.core.scheduler_output import RunnerSync, SchedulerOutput
from pagedllm.errors import InputError


@dataclass
class _ForkGroup:
    """Siblings of one n > 1 request that still wait to share the first sibling's prompt blocks."""

    leader: Request | None = None  # index 0: computes the prompt but its last token
    pending: set[str] = field(default_factory=set)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_offload: KVOffloadStore | None = None,
    ):
        """kv_offload: --kv-offload-dir's store (core/kv_offload.py): prefix-cache misses read blocks from
        it, and each step's output tells the runner which blocks to copy out for it and which to fill."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.sliding_window,
            kv_offload,
        )
        self.by_priority = scheduler_config.policy == "priority"
        self.waiting = make_request_queue(scheduler_config.policy, self._priority)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self._fork_groups: dict[str, _ForkGroup] = {}
        self._order: dict[str, int] = {}  # breaks arrival_time ties by add order
        self._next_order = 0
        self.runner_sync = RunnerSync()  # what the model runners hold of each request
        # LoRA (pagedllm/lora): adapters the running requests may use at once (the runner's device slots);
        # 0 = no limit (no adapters)
        self.max_loras = 0

    # -- admission -------------------------------------------------------------------------------

    def check_can_ever_fit(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """InputError when a request could never run to completion, however empty the engine."""
        max_len = self.scheduler_config.max_model_len
        if num_prompt_tokens > max_len:
            raise InputError(
                f"prompt has {num_prompt_tokens} tokens but the model's context length is {max_len}",
                param="prompt",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
            raise InputError(
                f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{num_prompt_tokens + max_tokens} tokens exceed the model's context length {max_len}",
                param="max_tokens",
            )
        total = num_prompt_tokens + max_tokens if max_tokens is not None else max_len
        num_blocks = cdiv(total, self.block_size)
        if num_blocks > self.cache_config.num_blocks:
            raise InputError(
                f"request needs up to {total} tokens = {num_blocks} KV blocks of {self.block_size} tokens "
                f"but the whole KV cache has {self.cache_config.num_blocks} blocks; "
                "lower max_tokens or give the KV cache more memory",
                param="max_tokens",
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._order[request.request_id] = self._next_order
        self._next_order += 1
        self.waiting.add_request(request)
        # n > 1 with something to share: the siblings wait for index 0's prompt blocks.
        if request.sampling_params.n > 1 and request.num_prompt_tokens > 1 and not request.output_token_ids:
            group = self._fork_groups.setdefault(request.group_id, _ForkGroup())
            if request.index == 0:
                group.leader = request
            else:
                group.pending.add(request.request_id)

    # -- scheduling ------------------------------------------------------------------------------

    def _priority(self, request: Request) -> tuple[float, ...]:
        """The request's rank, smallest first: arrival order, after its priority under the priority policy."""
        rank = request.arrival_time, self._order[request.request_id]
        return (request.priority, *rank) if self.by_priority else rank

    def _fork_limit(self, request: Request) -> int | None:
        """For a leader whose siblings still wait: stop its prefill before the last prompt token."""
        group = self._fork_groups.get(request.group_id)
        if group is None or group.leader is not request or not group.pending or request.output_token_ids:
            return None
        return request.num_prompt_tokens - 1

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to feed: the uncomputed ones, then its draft tokens, as far as the budget goes (drafts
        that do not fit are dropped)."""
        uncomputed = request.num_tokens - request.num_computed_tokens
        spec = request.spec_token_ids
        if spec:
            # drafts follow the last known token only, and never run past the context
            room = self.scheduler_config.max_model_len - request.num_tokens
            del spec[max(0, room) if uncomputed == 1 else 0 :]
        num_new = min(uncomputed + len(spec), budget)
        if spec:
            del spec[max(0, num_new - 1) :]
        limit = self._fork_limit(request)
        if limit is not None and request.num_computed_tokens < limit:
            num_new = min(num_new, limit - request.num_computed_tokens)
        return num_new

    def _sibling_action(self, request: Request) -> str:
        """'self' (prefill on its own), 'wait' (for the leader) or 'fork' (share the leader's blocks)."""
        group = self._fork_groups.get(request.group_id)
        if group is None or request.request_id not in group.pending:
            return "self"
        leader = group.leader
        if leader is None:  # the leader never came: nothing to share
            self._drop_pending(request)
            return "self"
        if (
            leader.status == RequestStatus.RUNNING
            and leader.num_computed_tokens >= request.num_prompt_tokens - 1
        ):
            return "fork"
        return "wait"

    def _admission_action(self, request: Request) -> str:
        """_sibling_action, and 'wait' while its grammar compiles (off the step; the others go on)."""
        if request.structured_output is not None and not request.structured_output.is_ready:
            return "wait"
        return self._sibling_action(request)

    def _lora_waits(self, request: Request) -> bool:
        """Its adapter is not among the running requests' and they already use max_loras adapters: it
        waits (keeping its place) until one of theirs finishes, as vLLM's scheduler does."""
        if not self.max_loras or not request.lora_int_id:
            return False
        active = {r.lora_int_id for r in self.running if r.lora_int_id}
        return request.lora_int_id not in active and len(active) >= self.max_loras

    def _drop_pending(self, request: Request) -> None:
        group = self._fork_groups.get(request.group_id)
        if group is None:
            return
        group.pending.discard(request.request_id)
        if not group.pending:
            del self._fork_groups[request.group_id]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        self._dissolve_if_leader(request)

    def _dissolve_if_leader(self, request: Request) -> None:
        # The leader's blocks are gone: its waiting siblings prefill on their own instead.
        group = self._fork_groups.get(request.group_id)
        if group is not None and group.leader is request:
            del self._fork_groups[request.group_id]

    def _preempt_for_waiting(self, preempted: list[str]) -> None:
        """Priority policy: while the first waiting request finds no free slot, or too few free blocks for a
        first chunk as long as a step's budget, and the lowest-ranked running request ranks below it, that
        one is preempted (vLLM's rule). This runs before anything is scheduled this step, so a victim never
        goes with tokens scheduled whose blocks the prefix cache already knows."""
        if not self.by_priority or not self.waiting:
            return
        head = self.waiting.peek_request()
        action = self._admission_action(head)
        if action == "wait":
            return
        chunk = min(head.num_tokens, self.scheduler_config.max_num_batched_tokens)
        while self.running:
            if len(self.running) < self.scheduler_config.max_num_seqs and (
                action == "fork" or self.kv_cache_manager.can_allocate(head, chunk)
            ):
                return
            victim = max(self.running, key=self._priority)
            if self._priority(victim) < self._priority(head):
                return
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        spec: dict[str, list[int]] = {}
        self._preempt_for_waiting(preempted)
        blocks_ran_short = False

        # 1. Running requests, oldest first, so the newest (the preemption victim) is always at the end
        #    and never one already scheduled this step.
        self.running.sort(key=self._priority)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0:
                i += 1
                continue
            while not kv.allocate_slots(request, num_new):
                if request.spec_token_ids:  # drafts are a guess: drop them before preempting anyone
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                blocks_ran_short = True
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            if request.spec_token_ids:
                spec[request.request_id] = list(request.spec_token_ids)
            budget -= num_new
            i += 1

        # 2. Waiting requests, first come first served (by rank under the priority policy); none when
        #    blocks ran short this step.
        if not blocks_ran_short:
            skipped: list[Request] = []  # siblings waiting for their leader keep their place
            while self.waiting and budget > 0 and len(self.running) < self.scheduler_config.max_num_seqs:
                request = self.waiting.peek_request()
                action = self._admission_action(request)
                if action == "wait" or self._lora_waits(request):
                    skipped.append(self.waiting.pop_request())
                    continue
                if action == "fork":
                    leader = self._fork_groups[request.group_id].leader
                    kv.fork(leader, request, request.num_prompt_tokens - 1)
                    num_new = self._num_new_tokens(request, budget)
                    if not kv.allocate_slots(request, num_new):
                        kv.free(request)
                        request.num_computed_tokens = 0
                        break
                    self._drop_pending(request)
                else:
                    computed_blocks, num_hit = kv.get_computed_blocks(request)
                    num_new = request.num_tokens - num_hit
                    limit = self._fork_limit(request)
                    if limit is not None and num_hit < limit:
                        num_new = limit - num_hit
                    num_new = min(num_new, budget)
                    if not kv.allocate_slots(request, num_new, computed_blocks):
                        break
                    if request.num_cached_tokens < 0:  # its first admission (vLLM's num_cached_tokens)
                        request.num_cached_tokens = num_hit
                self.waiting.pop_request()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append(request)
                num_scheduled[request.request_id] = num_new
                budget -= num_new
            self.waiting.prepend_requests(skipped)

        total = sum(num_scheduled.values())
        assert total <= self.scheduler_config.max_num_batched_tokens
        out = self.runner_sync.build(
            scheduled,
            num_scheduled,
            kv.take_blocks_to_copy(),
            preempted,
            {r: t for r, t in spec.items() if r not in preempted},
        )
        if kv.offload is not None:
            io = kv.take_offload_io()
            out.kv_blocks_to_save, out.kv_blocks_to_load = io.save, io.load
        return out

    # -- results ---------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]] | dict[str, int]
    ) -> list[Request]:
        """Advance computed tokens, append sampled ones, finish and free what stopped. Returns those.

        sampled: per request the tokens of this step, in order (a verified run: accepted drafts, then the
        target's own token; or one int). Stops (EOS, stop tokens, max_tokens) are checked token by token:
        the tokens after a stop are dropped, from `sampled` too, so the caller sees what was kept."""
        finished: list[Request] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:  # aborted while the step ran
                continue
            num_new = scheduler_output.num_scheduled_tokens[rid]
            tokens = sampled.get(rid)
            if isinstance(tokens, int):
                tokens = sampled[rid] = [tokens]
            num_drafts = len(spec.get(rid, ()))
            request.spec_token_ids = []
            if num_drafts:  # KV holds the last token and the accepted drafts; rejected ones are garbage
                num_new -= num_drafts - (len(tokens) - 1)
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens or not tokens:
                continue  # a prefill chunk: no token yet
            if request.first_token_time is None:
                request.first_token_time = time.time()
            status = None
            for n, token in enumerate(tokens, start=1):
                request.output_token_ids.append(token)
                status = self._check_stop(request)
                if status is not None:
                    del tokens[n:]
                    break
            if status is not None:
                request.status = status
                self.running.remove(request)
                self._free_finished(request)
                finished.append(request)
            elif num_drafts:
                self.kv_cache_manager.free_tail(request, request.num_tokens)
        return finished

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.scheduler_config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._dissolve_if_leader(request)
        self._drop_pending(request)
        self.runner_sync.finish(request.request_id)
        del self.requests[request.request_id]
        del self._order[request.request_id]

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        stop_reason: int | str | None = None,
    ) -> list[Request]:
        """Finish requests from outside (abort, or a stop string the engine found); waiting or running.
        Unknown or already finished ids are ignored. Returns the requests finished here."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        assert finished_status.is_finished()
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self._free_finished(request)
            finished.append(request)
        return finished

    # -- state -----------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request (finished ones leave the scheduler)."""
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
