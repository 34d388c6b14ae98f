"""KVEventLog: what the block pool and the scheduler did that a snapshot of the pool cannot show.

A snapshot (engine/kv_view.py) reads every block's ref_cnt and hash and every request's block table, so
allocations, frees and sharing need no event: they are visible in the state itself. Three things are
not, because they are over before the next snapshot: a cached prefix evicted to make room (the block is
in use again, its old hash gone), a copy-on-write (the copy's destination looks like any new block) and a
preemption (the request's blocks are simply free). Those are appended here as they happen.

The log exists only while someone watches (the /kv page): BlockPool.events and the engine's hook are None
otherwise, so an engine nobody watches pays one `is None` test on the paths that record, no more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["evict", "cow", "preempt"]
MAX_PENDING_EVENTS = 1000  # a burst beyond this between two snapshots keeps its newest events only


@dataclass(frozen=True)
class KVEvent:
    """One event. evict: block_id lost its cached prefix (block_hash) to new contents; cow: src's KV was
    copied into dst for request_id before it writes; preempt: request_id dropped its blocks."""

    kind: EventKind
    step: int
    block_id: int | None = None
    block_hash: int | None = None
    src: int | None = None
    request_id: str | None = None

    def to_json(self) -> dict[str, object]:
        """Plain fields for the page; the hash as 16 hex digits (a JS number would round it)."""
        out: dict[str, object] = {"kind": self.kind, "step": self.step}
        for name in ("block_id", "src", "request_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.block_hash is not None:
            out["hash"] = format_hash(self.block_hash)
        return out


def format_hash(block_hash: int) -> str:
    """A block hash (a signed Python int) as 16 hex digits, the way the page shows it."""
    return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class KVEventLog:
    """Events since the last drain(), plus running totals. Fed on the engine's thread only."""

    def __init__(self, max_pending: int = MAX_PENDING_EVENTS):
        self.step = 0  # the engine step the next events belong to (set by the engine's hook)
        self._pending: deque[KVEvent] = deque(maxlen=max_pending)
        self.num_evictions = 0
        self.num_copies = 0

    def evicted(self, block_id: int, block_hash: int) -> None:
        """BlockPool: a free block holding a cached prefix was handed out again."""
        self.num_evictions += 1
        self._pending.append(KVEvent("evict", self.step, block_id=block_id, block_hash=block_hash))

    def copied(self, src: int, dst: int, request_id: str | None) -> None:
        """The engine: this step copies src into dst before request_id writes into it."""
        self.num_copies += 1
        self._pending.append(KVEvent("cow", self.step, block_id=dst, src=src, request_id=request_id))

    def preempted(self, request_id: str) -> None:
        """The engine: request_id lost its blocks this step and will recompute (the scheduler counts them)."""
        self._pending.append(KVEvent("preempt", self.step, request_id=request_id))

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        out = list(self._pending)
        self._pending.clear()
        return out
