"""BlockPool: every KV block of the cache, a LRU free queue and the hash -> block map of the prefix cache.

A block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0), never both. A free block may
still hold a hash: its KV is intact and a later request with the same prefix can take it back (touch)
until it reaches the head of the free queue and is handed out again (evicted).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.kv_events import KVEventLog

BlockHash = int


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_salt=None) -> BlockHash:
    """Hash of one FULL block, chained over its parent so equal hashes mean equal whole prefixes.

    blake2b, not hash(): the same prefix must hash the same in every process, because the hashes name
    blocks on disk (--kv-offload-dir, core/kv_offload.py) and another server reads them back. (hash() of
    a tuple holding None or a str changes per process.) A signed 64-bit int, as before. extra_salt (e.g.
    an adapter's name in the first block) enters through its repr, which is stable for str and int."""
    h = hashlib.blake2b(digest_size=8)
    if parent_hash is not None:
        h.update(b"P" + parent_hash.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    if extra_salt is not None:
        h.update(b"S" + repr(extra_salt).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the prefix cache


@dataclass
class BlockPoolStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int  # free, but still holding a findable hash
    num_cached_blocks: int  # every block findable by hash, in use or free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict: O(1) removal from the middle (touch), O(1) pop from the head (allocation).
        # Head = freed longest ago = evicted first.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, Block] = {}
        self._num_cached_free = 0  # kept as a counter so stats stay O(1)
        # Set only while someone watches the pool (the /kv page): evictions are recorded there.
        self.events: KVEventLog | None = None
        # Set only with --kv-offload-dir: (block_id, hash) of each cached block evicted since the cache manager
        # last took them, so that its KV is copied out (and written to disk) before new contents overwrite it.
        self.evicted: list[tuple[int, BlockHash]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot get {num_blocks} blocks: only {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: Block) -> None:
        # The block gets new contents: forget its hash so no one finds stale KV under it.
        if block.block_hash is None:
            return
        self._num_cached_free -= 1  # only ever called on a block just taken off the free queue
        if self.events is not None:
            self.events.evicted(block.block_id, block.block_hash)
        if self.evicted is not None:
            self.evicted.append((block.block_id, block.block_hash))
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks another request (or the cache) holds; revives cached free blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 go to the tail of the free queue in the given order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def cache_full_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. False when caching is off, or another
        block already holds this hash (the duplicate stays unfindable and is evicted like any free block)."""
        if not self.enable_caching or block.block_hash is not None or block.ref_cnt == 0:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between benchmark runs, so a repeat does not skip its prefill).
        Only when no block is held: False, and nothing changed, while any request runs."""
        if any(b.ref_cnt > 0 for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self._num_cached_free = 0
        return True

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_free_blocks=self.num_cached_free_blocks,
            num_cached_blocks=len(self.cached_block_hash_to_block),
        )
