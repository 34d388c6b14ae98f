"""KVCacheManager with --kv-offload-dir's store (no model): which blocks a prefix-cache miss reads back, which
evicted blocks go out to disk, and that the pool stays consistent."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_offload import KVOffloadStore
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), **kw)


def store(tmp_path) -> KVOffloadStore:
    return KVOffloadStore(tmp_path, {"test": 1}, 1 << 20)


def test_evicted_blocks_go_out_and_come_back(tmp_path):
    s = store(tmp_path)
    kv = KVCacheManager(8, BS, offload=s)
    a = request("a", list(range(17)))  # 4 full blocks + 1 token
    blocks, n = kv.get_computed_blocks(a)
    assert (blocks, n) == ([], 0)
    assert kv.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    table = list(a.block_ids)
    kv.free(a)
    assert kv.take_offload_io().save == []  # nothing evicted yet
    b = request("b", [100 + t for t in range(29)])  # needs 8 blocks: evicts a's 4 cached ones
    kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 29)
    io = kv.take_offload_io()
    assert sorted(bid for bid, _ in io.save) == sorted(table[:4]) and io.load == []
    for _, h in io.save:  # the engine queues the runner's copies
        s.put(h, bytes(8), block=True)
    s.flush()
    kv.free(b)

    # a fresh manager (another process) finds a's 4 blocks on disk: as computed tokens, registered
    kv2 = KVCacheManager(8, BS, offload=s)
    a2 = request("a2", list(range(17)))
    blocks, n = kv2.get_computed_blocks(a2)
    assert n == 16 and len(blocks) == 4
    io = kv2.take_offload_io()
    assert [bid for bid, _ in io.load] == [b.block_id for b in blocks]
    assert kv2.offload_lookup_stats.hits == 16 and kv2.prefix_cache_stats.hits == 0
    assert kv2.num_free_blocks == 8  # loaded blocks sit in the free queue until the request takes them
    assert kv2.allocate_slots(a2, 1, blocks)
    assert a2.num_computed_tokens == 16 and kv2.num_free_blocks == 3


def test_prefix_hit_then_disk_and_lora_requests_read_nothing(tmp_path):
    s = store(tmp_path)
    kv = KVCacheManager(16, BS, offload=s)
    tokens = list(range(21))
    a = request("a", tokens)
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 21)
    hashes = list(kv.req_block_hashes["a"])
    kv.free(a)
    for h in hashes[2:]:  # the disk has blocks 2.. (0 and 1 stay in memory)
        s.put(h, bytes(8), block=True)
    s.flush()
    kv.block_pool.reset_prefix_cache()
    for h in hashes[:2]:  # blocks 0, 1 cached in memory again
        block = kv.block_pool.get_new_blocks(1)[0]
        kv.block_pool.cache_full_block(block, h)
        kv.block_pool.free_blocks([block])
    b = request("b", tokens)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 20 and kv.prefix_cache_stats.hits == 8 and kv.offload_lookup_stats.hits == 12
    kv.take_offload_io()
    # a LoRA request's blocks on disk are never read (its hash salt, lora_int_id, is per process)
    lora = request("c", [t + 1000 for t in tokens], lora_int_id=1)
    for h in kv._block_hashes(lora, 5):
        s.put(h, bytes(8), block=True)
    s.flush()
    assert kv.get_computed_blocks(lora) == ([], 0)
    assert kv.get_computed_blocks(request("d", [t + 1000 for t in tokens])) == ([], 0)  # other hashes
