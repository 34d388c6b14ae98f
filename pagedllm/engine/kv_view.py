"""KVCacheView: a read-only picture of one engine's paged KV cache, for the /kv page.

The page must never reach into the scheduler, and an engine nobody watches must not pay for being
watchable. So this is the one narrow interface between them: the engine builds a view when the first
page subscribes (LLMEngine.open_kv_view) and drops it when the last leaves; while it exists, the block
pool records evictions and the engine's step hook records copies-on-write and preemptions into its
KVEventLog, and `snapshot()` reads the pool's blocks and the requests' block tables as plain data.

Every method runs on the engine's thread, between steps (AsyncEngine calls them there), so what a
snapshot shows is one consistent moment of the pool; the dicts it returns are fresh and never changed
afterwards, so they may cross to the server's event loop.

A block's state, one character of `states` each (the order of STATES):
  free     ref_cnt 0, no cached prefix          cached   ref_cnt 0, still findable by its hash
  used     one holder                           shared   ref_cnt > 1 (a shared prefix, a forked prompt)
  cow      one holder that got it by copy-on-write (until it is freed)
  evicted  one holder, and the block held a cached prefix until it was handed out, EVICTED_FLASH_S ago at most
"""

from __future__ import annotations

import time
from itertools import chain
from typing import TYPE_CHECKING, Any

from pagedllm import planner
from pagedllm.core.kv_events import KVEvent, KVEventLog, format_hash
from pagedllm.engine.kv_tokens import BlockTokens
from pagedllm.errors import InputError

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import SchedulerOutput

STATES = ("free", "cached", "used", "shared", "cow", "evicted")
_CODE = {name: ord(str(i)) for i, name in enumerate(STATES)}
EVICTED_FLASH_S = 2.0  # how long a block whose cached prefix was evicted shows it


class KVCacheView:
    """Snapshots of the pool and the requests' block tables; the event log it attaches to the pool."""

    def __init__(self, scheduler: Scheduler, *, max_model_len: int, block_bytes: int):
        """block_bytes: what one block costs in memory (the planner's block_bytes, a draft model's KV
        included), so waste in tokens converts to bytes as `pagedllm plan` converts it."""
        self._scheduler = scheduler
        self._pool = scheduler.kv_cache_manager.block_pool
        self.block_size = scheduler.block_size
        self.max_model_len = max_model_len
        self.block_bytes = block_bytes
        self.log = KVEventLog()
        self._step = 0
        self._cow_owner: dict[int, str] = {}  # copy-on-write destination -> the request that holds it
        self._evicted_at: dict[int, float] = {}  # block id -> when its cached prefix was evicted
        self._tokens = BlockTokens(self._pool.blocks, self.block_size)  # for the hover's text
        self._pool.events = self.log

    def close(self) -> None:
        """Stop recording: the pool and the engine go back to paying nothing."""
        if self._pool.events is self.log:
            self._pool.events = None

    # -- fed by the engine's step ------------------------------------------------------------------

    def on_schedule(self, sched_out: SchedulerOutput) -> None:
        """After Scheduler.schedule(): record the step's preemptions and copies-on-write."""
        self._step += 1
        self.log.step = self._step
        for request_id in sched_out.preempted_request_ids:
            self.log.preempted(request_id)
            self._cow_owner = {b: r for b, r in self._cow_owner.items() if r != request_id}
        requests = self._scheduler.requests
        for src, dst in sched_out.blocks_to_copy:
            owner = next(
                (rid for rid in sched_out.num_scheduled_tokens if dst in requests[rid].block_ids), None
            )
            self.log.copied(src, dst, owner)
            if owner is not None:
                self._cow_owner[dst] = owner

    # -- read --------------------------------------------------------------------------------------

    def _requests(self) -> list[Request]:
        return [*self._scheduler.running, *self._scheduler.waiting]

    def _states(self, requests: list[Request]) -> tuple[bytearray, dict[str, int]]:
        """Every block's state code, and the ref_cnt of the shared ones. O(blocks held + cached), in tight
        loops: a pool of tens of thousands of blocks is drawn 10 times a second."""
        pool, blocks = self._pool, self._pool.blocks
        states = bytearray(b"0") * len(blocks)
        cached, used, shared, cow, evicted = (
            _CODE[s] for s in ("cached", "used", "shared", "cow", "evicted")
        )
        for block in pool.cached_block_hash_to_block.values():
            if block.ref_cnt == 0:
                states[block.block_id] = cached
        held = set(chain.from_iterable(r.block_ids for r in requests))
        if held and min(held) < 0:  # a negative entry was freed out of a sliding window
            held = {i for i in held if i >= 0}
        if len(held) != pool.num_blocks - pool.num_free_blocks:  # a holder we do not see: scan them all
            held = {b.block_id for b in blocks if b.ref_cnt > 0}
        ref_cnts: dict[str, int] = {}
        for block_id in held:
            n = blocks[block_id].ref_cnt
            if n > 1:
                states[block_id] = shared
                ref_cnts[str(block_id)] = n
            else:
                states[block_id] = used
        for block_id in self._cow_owner:
            if states[block_id] == used:
                states[block_id] = cow
        for block_id in self._evicted_at:
            if states[block_id] == used:
                states[block_id] = evicted
        return states, ref_cnts

    def _forget_stale(self, requests: list[Request], events: list[KVEvent], now: float) -> None:
        """Drop copy-on-write marks whose block left its owner, and eviction marks past EVICTED_FLASH_S."""
        for event in events:
            if event.kind == "evict":
                self._evicted_at[event.block_id] = now
        self._evicted_at = {b: t for b, t in self._evicted_at.items() if now - t < EVICTED_FLASH_S}
        by_id = {r.request_id: r for r in requests}
        self._cow_owner = {b: r for b, r in self._cow_owner.items() if r in by_id and b in by_id[r].block_ids}

    def _row(self, request: Request) -> dict[str, Any]:
        """One request: its table and what its slots hold, beside what a max_model_len reservation wastes."""
        s, table = request.num_computed_tokens, list(request.block_ids)
        tail = len(table) * self.block_size - s if table else 0
        naive = planner.waste(self.max_model_len, self.block_size, s).naive_waste_tokens if s else None
        return {
            "id": request.request_id,
            "group": request.group_id,
            "status": request.status.name.lower(),
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_tokens": request.num_tokens,
            "num_computed_tokens": s,
            "table": table,
            "tail_waste": tail,
            "naive_waste": naive,
            "num_preemptions": request.num_preemptions,
        }

    def snapshot(self) -> dict[str, Any]:
        """The whole picture, as JSON-ready data: every block's state, every request's row, the totals and
        the events since the previous snapshot."""
        now = time.monotonic()
        events = self.log.drain()
        requests = self._requests()
        self._forget_stale(requests, events, now)
        self._tokens.update(requests)
        states, ref_cnts = self._states(requests)
        rows = [self._row(r) for r in requests]
        return {
            "step": self._step,
            "block_size": self.block_size,
            "num_blocks": len(states),
            "max_model_len": self.max_model_len,
            "block_bytes": self.block_bytes,
            "state_names": list(STATES),  # states[i] is the index of block i's state in this list
            "states": states.decode("ascii"),
            "ref_cnts": ref_cnts,
            "requests": rows,
            "totals": self._totals(states, rows),
            "events": [e.to_json() for e in events],
        }

    def _totals(self, states: bytearray, rows: list[dict[str, Any]]) -> dict[str, int]:
        counts = {name: states.count(code) for name, code in _CODE.items()}
        used_tokens = sum(r["num_computed_tokens"] for r in rows)
        waste = sum(r["tail_waste"] for r in rows)
        naive = sum(r["naive_waste"] or 0 for r in rows)
        per_token = self.block_bytes // self.block_size
        return {
            **{f"{name}_blocks": n for name, n in counts.items()},
            "in_use_blocks": counts["used"] + counts["shared"] + counts["cow"] + counts["evicted"],
            "used_tokens": used_tokens,
            "waste_tokens": waste,
            "waste_bytes": waste * per_token,
            "naive_waste_tokens": naive,
            "naive_waste_bytes": naive * per_token,
            "num_preemptions": self._scheduler.num_preemptions,
            "num_evictions": self.log.num_evictions,
            "num_copies": self.log.num_copies,
        }

    def block_info(self, block_id: int) -> dict[str, Any]:
        """One block for the page's hover: state, ref_cnt, hash, holders and the ids of its tokens
        (None when they are not known: the block was filled before anyone watched)."""
        blocks = self._pool.blocks
        if not 0 <= block_id < len(blocks):
            raise InputError(f"block_id must be in [0, {len(blocks)}), got {block_id}", param="block_id")
        requests = self._requests()
        self._tokens.update(requests)
        states, _ = self._states(requests)
        block = blocks[block_id]
        return {
            "block_id": block_id,
            "state": STATES[states[block_id] - _CODE["free"]],
            "ref_cnt": block.ref_cnt,
            "hash": format_hash(block.block_hash) if block.block_hash is not None else None,
            "holders": [r.request_id for r in requests if block_id in r.block_ids],
            "token_ids": self._tokens.get(block_id, held=block.ref_cnt > 0),
        }

    def manager_state(self) -> dict[str, Any]:
        """Test-only ground truth, read straight from the KVCacheManager without this view's arithmetic:
        each request's table and computed tokens, every block's ref_cnt, the free count."""
        kv = self._scheduler.kv_cache_manager
        return {
            "step": self._step,
            "block_size": kv.block_size,
            "num_free_blocks": kv.num_free_blocks,
            "ref_cnts": [b.ref_cnt for b in kv.block_pool.blocks],
            "requests": {
                r.request_id: {"block_ids": list(r.block_ids), "num_computed_tokens": r.num_computed_tokens}
                for r in self._scheduler.requests.values()
            },
        }
