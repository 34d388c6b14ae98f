from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=None))


class FakeKV:
    """What the physical cache would hold: block id -> {offset: (position, token)}."""

    def __init__(self):
        self.slots: dict[int, dict[int, tuple[int, int]]] = {}

    def copy(self, pairs):
        for src, dst in pairs:
            self.slots[dst] = dict(self.slots.get(src, {}))

    def write(self, request: Request, start: int, end: int, block_size: int):
        tokens = request.all_token_ids
        for pos in range(start, end):
            block = request.block_ids[pos // block_size]
            self.slots.setdefault(block, {})[pos % block_size] = (pos, tokens[pos])

    def read(self, request: Request, end: int, block_size: int) -> list[int]:
        out = []
        for pos in range(end):
            got_pos, token = self.slots[request.block_ids[pos // block_size]][pos % block_size]
            assert got_pos == pos
            out.append(token)
        return out


def compute(kv: KVCacheManager, fake: FakeKV, request: Request, num_new: int, computed_blocks=None) -> bool:
    """What the scheduler + runner do for one request: allocate, copy on write, write the KV."""
    if not kv.allocate_slots(request, num_new, computed_blocks):
        return False
    fake.copy(kv.take_blocks_to_copy())
    start = request.num_computed_tokens
    fake.write(request, start, start + num_new, kv.block_size)
    request.num_computed_tokens += num_new
    return True


def test_allocate_reserves_only_what_new_tokens_need():
    kv = KVCacheManager(10, BS)
    r = make_request("a", range(9))
    assert kv.allocate_slots(r, 5)
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3)  # 8 tokens: still 2 blocks
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1)
    assert len(r.block_ids) == 3
    assert kv.num_free_blocks == 7
    assert abs(kv.usage - 0.3) < 1e-9


def test_allocate_fails_without_changing_anything():
    kv = KVCacheManager(3, BS)
    a = make_request("a", range(8))
    assert kv.allocate_slots(a, 8)
    b = make_request("b", range(100, 108))
    assert not kv.can_allocate(b, 8)
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1


def test_prefix_hit_maps_to_same_physical_blocks_and_never_whole_prompt():
    kv = KVCacheManager(16, BS)
    fake = FakeKV()
    a = make_request("a", range(12))  # 3 full blocks
    blocks, n = kv.get_computed_blocks(a)
    assert (blocks, n) == ([], 0)
    assert compute(kv, fake, a, 12)
    b = make_request("b", list(range(12)))  # identical prompt: last block must be recomputed
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == a.block_ids[:2]
    assert compute(kv, fake, b, 4, blocks)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert fake.read(b, 12, BS) == list(range(12))
    c = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.prefix_cache_stats.queries == 12 + 12 + 13
    assert kv.prefix_cache_stats.hits == kv.prefix_cache_hits == 16
    assert kv.prefix_cache_queries == 37


def test_freed_cached_blocks_are_reused_then_evicted_tail_first():
    kv = KVCacheManager(4, BS)
    fake = FakeKV()
    a = make_request("a", range(13))
    assert compute(kv, fake, a, 13)  # 4 blocks, 3 full and cached
    ids = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 3
    # A new request takes one block: the tail (freed first) goes, the prefix stays cached.
    x = make_request("x", [50, 51])
    assert compute(kv, fake, x, 2)
    assert x.block_ids == [ids[3]]
    y = make_request("y", [60, 61])
    assert compute(kv, fake, y, 2)
    assert y.block_ids == [ids[2]]
    again = make_request("again", range(13))
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8 and [b.block_id for b in blocks] == ids[:2]


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(16, BS)
    fake = FakeKV()
    parent = make_request("p", range(10))
    assert compute(kv, fake, parent, 9)  # blocks: full, full, partial (1 token)
    child = make_request("c", range(10))
    kv.fork(parent, child, 9)
    assert child.block_ids == parent.block_ids and child.num_computed_tokens == 9
    assert [kv.block_pool.blocks[i].ref_cnt for i in parent.block_ids] == [2, 2, 2]
    # The child writes token 9 into the shared partial block: copy first.
    assert kv.allocate_slots(child, 1)
    copies = kv.take_blocks_to_copy()
    assert copies == [(parent.block_ids[2], child.block_ids[2])]
    fake.copy(copies)
    fake.write(child, 9, 10, BS)
    child.num_computed_tokens = 10
    assert child.block_ids[:2] == parent.block_ids[:2] and child.block_ids[2] != parent.block_ids[2]
    assert kv.block_pool.blocks[parent.block_ids[2]].ref_cnt == 1
    # The last holder writes in place.
    assert compute(kv, fake, parent, 1)
    assert kv.take_blocks_to_copy() == []
    assert fake.read(parent, 10, BS) == list(range(10)) == fake.read(child, 10, BS)
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 16


def test_cow_needs_a_free_block():
    kv = KVCacheManager(3, BS)
    fake = FakeKV()
    parent = make_request("p", range(6))
    assert compute(kv, fake, parent, 5)
    child = make_request("c", range(6))
    kv.fork(parent, child, 5)
    other = make_request("o", range(50, 54))
    assert compute(kv, fake, other, 4)
    assert kv.num_free_blocks == 0
    assert not kv.can_allocate(child, 1)
    assert not kv.allocate_slots(child, 1)
    assert kv.take_blocks_to_copy() == []


def test_no_prefix_caching():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    fake = FakeKV()
    a = make_request("a", range(9))
    assert compute(kv, fake, a, 9)
    b = make_request("b", range(9))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.num_cached_free_blocks == 0


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / eviction pressure against an exact model of the cache."""

    NUM_BLOCKS = 12

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS)
        self.fake = FakeKV()
        self.live: dict[str, Request] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # A tiny alphabet and shared stems make prefix hits and hash reuse frequent.
    @rule(
        stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 3), max_size=9),
    )
    def allocate(self, stem, tail):
        tokens = stem + tail
        if not tokens:
            return
        r = make_request(self._new_id(), tokens)
        blocks, n = self.kv.get_computed_blocks(r)
        assert n % BS == 0 and n < len(tokens)
        if compute(self.kv, self.fake, r, len(tokens) - n, blocks):
            assert r.num_computed_tokens == len(tokens)
            self.live[r.request_id] = r
        else:
            assert r.block_ids == [] and r.num_computed_tokens == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r.output_token_ids.append(token)
        if not compute(self.kv, self.fake, r, 1):
            r.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        k = data.draw(st.integers(1, parent.num_computed_tokens))
        child = make_request(self._new_id(), parent.all_token_ids[:k])
        self.kv.fork(parent, child, k)
        self.live[child.request_id] = child
        # The child's next token goes into the shared block when k is mid-block: copy on write.
        child.output_token_ids.append(data.draw(st.integers(0, 3)))
        compute(self.kv, self.fake, child, child.num_tokens - child.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)
        assert r.block_ids == []

    @rule(n=st.integers(1, 40))
    def evict(self, n):
        # Fresh tokens that no one shares: takes free blocks, evicting cached ones.
        r = make_request(self._new_id(), [1000 + self.next_id * 100 + i for i in range(n)])
        if compute(self.kv, self.fake, r, n):
            self.live[r.request_id] = r

    @invariant()
    def refcounts_match_block_tables(self):
        pool = self.kv.block_pool
        held = Counter(i for r in self.live.values() for i in r.block_ids)
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == held[block.block_id]
            in_free_queue = block.block_id in pool.free_queue
            assert in_free_queue == (block.ref_cnt == 0)  # never both free and in use
        assert sum(b.ref_cnt for b in pool.blocks) == sum(held.values())
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)

    @invariant()
    def prefix_cache_is_consistent(self):
        pool = self.kv.block_pool
        for h, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == h
        assert pool.num_cached_free_blocks == sum(
            1 for b in pool.free_queue.values() if b.block_hash is not None
        )

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for r in self.live.values():
            assert len(r.block_ids) == cdiv(r.num_computed_tokens, BS)
            assert self.fake.read(r, r.num_computed_tokens, BS) == r.all_token_ids[: r.num_computed_tokens]

    def teardown(self):
        for r in list(self.live.values()):
            self.kv.free(r)
        assert self.kv.num_free_blocks == self.NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
