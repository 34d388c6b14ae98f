import pytest

from pagedllm.core.block_pool import BlockPool, hash_block_tokens


def test_allocate_and_free_all():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(5)
    assert [b.ref_cnt for b in blocks] == [1] * 5
    assert len({b.block_id for b in blocks}) == 5
    assert pool.num_free_blocks == 3
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_cannot_take_more_than_free():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_lru_order_freed_longest_ago_is_evicted_first():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    for blk, h in zip((a, b, c, d), (11, 22, 33, 44)):
        assert pool.cache_full_block(blk, h)
    pool.free_blocks([c, a, d, b])
    assert pool.stats().num_cached_free_blocks == 4
    # Allocation takes from the head: c was freed first.
    (x,) = pool.get_new_blocks(1)
    assert x is c
    assert x.block_hash is None and pool.get_cached_block(33) is None
    assert pool.get_cached_block(11) is a  # the others stay findable
    assert pool.num_cached_free_blocks == 3


def test_touch_revives_cached_free_block_and_keeps_it_from_eviction():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, hash_block_tokens(None, [1, 2]))
    pool.free_blocks([a, b, c])
    hit = pool.get_cached_block(hash_block_tokens(None, [1, 2]))
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2 and pool.num_cached_free_blocks == 0
    got = pool.get_new_blocks(2)
    assert a not in got
    assert pool.get_cached_block(hash_block_tokens(None, [1, 2])) is a


def test_touch_shared_block_increments_refcount():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, 7)
    assert not pool.cache_full_block(b, 7)
    assert b.block_hash is None and pool.get_cached_block(7) is a


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, 5)
    assert pool.get_cached_block(5) is None


def test_hash_chain_depends_on_parent():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, (1, 2, 3)) == h1
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(h1, [4, 5, 6], extra_salt="x") != hash_block_tokens(h1, [4, 5, 6])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3])
    assert pool.cache_full_block(blocks[0], h)
    assert not pool.reset_prefix_cache()  # a request still holds blocks: nothing dropped
    assert pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.num_cached_free_blocks == 1
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 4 and blocks[0].block_hash is None
