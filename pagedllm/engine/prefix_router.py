"""PrefixRouter: which data-parallel replica takes a request (prefix affinity first, then the least loaded).

Plain bookkeeping, no Ray: engine/data_parallel.py asks it for every request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedllm.core.block_pool import BlockHash, hash_block_tokens
from pagedllm.engine.protocol import EngineClosedError


class PrefixRouter:
    """Chooses a replica for each request: prefix affinity first, then the fewest in-flight requests.

    It knows only what it sent where: `assign` records the prompt's block hashes under the replica (an
    LRU map of at most `capacity` hashes) and counts the request in flight until `release`. Hashes are the
    prefix cache's own (hash_block_tokens over each full block, chained to its parent), so a hit means
    the whole prefix up to that block went to that replica, whose prefix cache is likely to hold it still.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        capacity: int = 1 << 16,
        min_match_fraction: float = 0.5,
        max_imbalance: int = 16,
        enable_prefix_affinity: bool = True,
    ):
        if num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.capacity = capacity
        self.min_match_fraction = min_match_fraction
        self.max_imbalance = max_imbalance
        self.enable_prefix_affinity = enable_prefix_affinity
        self.alive = [True] * num_replicas
        self.in_flight = [0] * num_replicas
        self.num_prefix_hits = 0  # requests routed by prefix affinity
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()
        self._next = 0  # rotates among equally loaded replicas

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The chained hashes of the prompt's full blocks (the partial last block has none)."""
        bs = self.block_size
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def live_replicas(self, exclude: Iterable[int] = ()) -> list[int]:
        skip = set(exclude)
        return [r for r in range(self.num_replicas) if self.alive[r] and r not in skip]

    def choose(self, token_ids: Sequence[int], exclude: Iterable[int] = ()) -> int:
        """The replica for a prompt, among the live ones not in `exclude`; EngineClosedError if none."""
        candidates = self.live_replicas(exclude)
        if not candidates:
            raise EngineClosedError("no engine replica is alive to take the request")
        start = self._next
        least = min(candidates, key=lambda r: (self.in_flight[r], (r - start) % self.num_replicas))
        if self.enable_prefix_affinity:
            hashes = self.block_hashes(token_ids)
            for depth in range(len(hashes), 0, -1):
                owner = self._owner.get(hashes[depth - 1])
                if owner is None or owner not in candidates:
                    continue
                if depth < self.min_match_fraction * len(hashes):
                    break  # the shared part is the smaller one: balance load instead
                if self.in_flight[owner] - self.in_flight[least] > self.max_imbalance:
                    break  # too busy for the cache hit to pay
                self.num_prefix_hits += 1
                return owner
        self._next = (least + 1) % self.num_replicas
        return least

    def assign(self, token_ids: Sequence[int], replica: int) -> None:
        """Record that the request went to `replica`: its prefix hashes, and one more in flight there."""
        self.in_flight[replica] += 1
        if not self.enable_prefix_affinity:
            return
        for h in self.block_hashes(token_ids):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def release(self, replica: int) -> None:
        """A request on `replica` finished, failed or was aborted."""
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def mark_dead(self, replica: int) -> None:
        """Never choose `replica` again, and forget what it cached."""
        self.alive[replica] = False
        self.in_flight[replica] = 0
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
