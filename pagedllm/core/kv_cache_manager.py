"""KVCacheManager: gives requests KV blocks as their tokens arrive, shares prefixes, copies on write.

The block table lives on the request (request.block_ids); this class is the only one that changes it.

With a sliding window over every layer, a block whose tokens all lie before the window of the request's
next query is never read again: it goes back to the pool (still findable by its hash) and its table entry
becomes NULL_BLOCK_ID, so the table keeps its positions (vLLM's null block; the runner reads such entries
as block 0, which no windowed query attends to).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from pagedllm.core.kv_offload import KVOffloadStore
from pagedllm.core.request import Request

NULL_BLOCK_ID = -1  # a table entry whose block was freed: wholly before the sliding window


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache (like vLLM, counted in tokens)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class OffloadIO:
    """A step's disk traffic for the runner: blocks to copy out before anything overwrites them (evicted
    this step; the engine then queues their bytes for the disk) and blocks to fill with bytes read back."""

    save: list[tuple[int, BlockHash]]  # (block_id, hash)
    load: list[tuple[int, bytes]]  # (block_id, payload)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        offload: KVOffloadStore | None = None,
    ):
        """offload: --kv-offload-dir's store. A prefix-cache miss then reads the next blocks from it, and
        evicted cached blocks are handed out (take_offload_io) to be written there."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        # Hash chain of each request's full blocks, grown lazily (tokens never change once appended).
        self.req_block_hashes: dict[str, list[BlockHash]] = {}
        # How many of a request's leading blocks are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Copy-on-write (src, dst) pairs since the scheduler last took them; copied before the next forward.
        self.blocks_to_copy: list[tuple[int, int]] = []
        # How many of a request's leading table entries are NULL_BLOCK_ID (freed out of the window).
        self.num_skipped_blocks: dict[str, int] = {}
        # --kv-offload-dir: tokens looked up on disk after a prefix-cache miss, and found there (vLLM's
        # external_prefix_cache_queries / _hits); blocks read this step wait here for the runner
        self.offload = offload
        self.offload_lookup_stats = PrefixCacheStats()
        self._blocks_to_load: list[tuple[int, bytes]] = []
        if offload is not None:
            self.block_pool.evicted = []

    # -- queries ---------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached but free blocks count as free: they can be evicted)."""
        return 1.0 - self.block_pool.num_free_blocks / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.block_pool.num_cached_free_blocks

    @property
    def prefix_cache_queries(self) -> int:
        return self.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.prefix_cache_stats.hits

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_full_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            # a LoRA adapter's KV differs from the base's and every other adapter's: its id salts the first
            # block's hash, and the chain carries it to every later block
            lora = request.lora_int_id or None
            for i in range(len(hashes), num_full_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], lora if i == 0 else None)
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, and how many tokens it covers.

        Never the whole sequence: the last token must be computed so there are logits to sample from.
        None for a request that asks for prompt logprobs: every prompt position must run through the model
        (vLLM does the same), though its blocks are still cached for others.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += len(blocks) * self.block_size
        # not for a LoRA adapter's request: its hashes are salted by lora_int_id, a number each process
        # gives its adapters in load order, so another server's blocks under it may be another adapter's
        if self.offload is not None and len(blocks) < max_blocks and not request.lora_int_id:
            blocks += self._load_offloaded(request, blocks, max_blocks)
        return blocks, len(blocks) * self.block_size

    def _load_offloaded(self, request: Request, hit: list[Block], max_blocks: int) -> list[Block]:
        """The blocks after the prefix-cache hit that the disk has, read into fresh blocks and registered
        in the prefix cache, as if computed (the runner copies the bytes in before this step's forward).
        As many as the free queue spares; the run stops at the first block absent or bad on disk."""
        pool = self.block_pool
        hashes = self.req_block_hashes[request.request_id]
        start = len(hit)
        self.offload_lookup_stats.queries += request.num_tokens - start * self.block_size
        # the hit blocks leave the free queue meanwhile: taking fresh blocks must not evict one of them
        pool.touch(hit)
        payloads = []
        for i in range(start, min(max_blocks, start + pool.num_free_blocks)):
            payload = self.offload.read(hashes[i])
            if payload is None:
                break
            payloads.append(payload)
        loaded = pool.get_new_blocks(len(payloads)) if payloads else []
        for i, (block, payload) in enumerate(zip(loaded, payloads)):
            pool.cache_full_block(block, hashes[start + i])
            self._blocks_to_load.append((block.block_id, payload))
        # back as they were: the request (or a later one) takes them like any cached block; freed tail
        # first, so that the prefix's first blocks are evicted last
        pool.free_blocks(reversed(hit + loaded))
        self.offload_lookup_stats.hits += len(loaded) * self.block_size
        return loaded

    def take_offload_io(self) -> OffloadIO:
        """Evicted cached blocks the disk does not have yet, and the blocks read back, since the last call."""
        evicted = self.block_pool.evicted or []
        known = self.offload.known if self.offload is not None else set()
        save = [(block_id, h) for block_id, h in evicted if h not in known]
        evicted.clear()
        load, self._blocks_to_load = self._blocks_to_load, []
        return OffloadIO(save, load)

    def cached_blocks_not_offloaded(self) -> list[tuple[int, BlockHash]]:
        """(block_id, hash) of every cached block the disk does not have yet: written at shutdown."""
        known = self.offload.known if self.offload is not None else set()
        return [
            (b.block_id, h) for h, b in self.block_pool.cached_block_hash_to_block.items() if h not in known
        ]

    # -- allocation ------------------------------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, computed_blocks: list[Block]):
        """(blocks to take from the free queue, table indexes to copy on write, total tokens)."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_table = len(request.block_ids) + len(computed_blocks)
        num_new_blocks = max(0, cdiv(total, self.block_size) - num_table)
        # Blocks the new tokens land in that someone else also holds (a forked partial block), or that the
        # prefix cache knows under a hash (a partial block forked from a parent that filled and cached it,
        # then left): copy first. Computed (prefix-cache) blocks are full and lie before num_computed, so
        # they are never written.
        first = num_computed // self.block_size
        blocks = self.block_pool.blocks
        cow = [
            i
            for i in range(first, len(request.block_ids))
            if blocks[request.block_ids[i]].ref_cnt > 1 or blocks[request.block_ids[i]].block_hash is not None
        ]
        # A cached block sitting in the free queue leaves it when we take it: it costs a free block too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return num_new_blocks + len(cow) + num_revived, cow, total

    def remove_skipped_blocks(self, request: Request) -> int:
        """Free the blocks before the sliding window of the request's next query (position
        num_computed_tokens sees keys from num_computed_tokens - window + 1 on); returns how many."""
        if self.sliding_window is None:
            return 0
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        skip = min(max(0, first_needed) // self.block_size, len(request.block_ids))
        done = self.num_skipped_blocks.get(request.request_id, 0)
        if skip <= done:
            return 0
        ids = request.block_ids
        # latest first: the free queue evicts from its head, so the oldest (a shared prompt's first
        # blocks, which every later prefix-cache hit needs) stays findable longest
        self.block_pool.free_blocks(self.block_pool.blocks[ids[i]] for i in reversed(range(done, skip)))
        ids[done:skip] = [NULL_BLOCK_ID] * (skip - done)
        self.num_skipped_blocks[request.request_id] = skip
        return skip - done

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the request holds: its table less the entries freed out of the window."""
        return len(request.block_ids) - self.num_skipped_blocks.get(request.request_id, 0)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> bool:
        self.remove_skipped_blocks(request)  # what it gives back counts as free
        needed, _, _ = self._plan(request, num_new_tokens, computed_blocks or [])
        return needed <= self.block_pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens after the request's computed ones.

        computed_blocks (from get_computed_blocks, request without blocks) join the block table and
        advance request.num_computed_tokens. Returns False, changing nothing, when blocks run short.
        Only what these tokens need is reserved: decode steps add a block every block_size tokens.
        """
        computed_blocks = computed_blocks or []
        self.remove_skipped_blocks(request)
        needed, cow, total = self._plan(request, num_new_tokens, computed_blocks)
        if needed > self.block_pool.num_free_blocks:
            return False
        pool = self.block_pool
        if computed_blocks:
            pool.touch(computed_blocks)
            request.block_ids.extend(b.block_id for b in computed_blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
        for i in cow:
            old = pool.blocks[request.block_ids[i]]
            (new,) = pool.get_new_blocks(1)
            if i * self.block_size < request.num_computed_tokens:  # holds KV we must keep
                self.blocks_to_copy.append((old.block_id, new.block_id))
            pool.free_blocks([old])  # ref_cnt > 1, so it stays in use by the other holders
            request.block_ids[i] = new.block_id
        num_new_blocks = cdiv(total, self.block_size) - len(request.block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(b.block_id for b in pool.get_new_blocks(num_new_blocks))
        # Registered now, not after the forward, so a request admitted later in this same step already
        # shares these blocks (as in vLLM): it sits later in the batch, and each layer writes the
        # batch's KV before attention reads it. Draft tokens are not the request's tokens yet: only
        # blocks full of known tokens are hashed.
        self.cache_blocks(request, min(total, request.num_tokens))
        return True

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens: after a verification, those that held
        only rejected draft tokens. They were never hashed (cache_blocks stops at known tokens)."""
        keep = cdiv(num_tokens, self.block_size)
        if len(request.block_ids) <= keep:
            return
        tail = request.block_ids[keep:]
        del request.block_ids[keep:]
        self.block_pool.free_blocks(self.block_pool.blocks[i] for i in reversed(tail))

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's blocks that are full within its first num_tokens tokens
        (default: its computed tokens) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = min(num_tokens // self.block_size, len(request.block_ids))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if request.block_ids[i] != NULL_BLOCK_ID:
                self.block_pool.cache_full_block(self.block_pool.blocks[request.block_ids[i]], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Share the parent's blocks holding its first num_tokens tokens (default: its computed ones)
        with the child: no copy, ref_cnt + 1 each; the child starts computed up to num_tokens."""
        if child.block_ids:
            raise ValueError(f"fork into {child.request_id!r}, which already holds blocks")
        if num_tokens is None:
            num_tokens = parent.num_computed_tokens
        if num_tokens > parent.num_computed_tokens:
            raise ValueError(
                f"fork of {num_tokens} tokens but the parent computed {parent.num_computed_tokens}"
            )
        table = parent.block_ids[: cdiv(num_tokens, self.block_size)]
        self.block_pool.touch(self.block_pool.blocks[i] for i in table if i != NULL_BLOCK_ID)
        child.block_ids = list(table)
        child.num_computed_tokens = num_tokens
        skipped = sum(1 for i in table if i == NULL_BLOCK_ID)
        if skipped:
            self.num_skipped_blocks[child.request_id] = skipped

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail blocks are evicted before its prefix."""
        pool = self.block_pool
        pool.free_blocks(pool.blocks[i] for i in reversed(request.block_ids) if i != NULL_BLOCK_ID)
        request.block_ids = []
        self.req_block_hashes.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_skipped_blocks.pop(request.request_id, None)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        out, self.blocks_to_copy = self.blocks_to_copy, []
        return out
