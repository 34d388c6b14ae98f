"""core/kv_offload.py: the disk store of --kv-offload-dir (no model, no torch), and worker/kv_transfer.py's
byte copies of blocks out of and into a paged cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.core.kv_offload import HEADER, KVOffloadStore

IDENTITY = {"model": "m", "kv_cache_dtype": "torch.float32", "block_size": 16}


def _store(root, identity=IDENTITY, max_bytes=1 << 20, **kw) -> KVOffloadStore:
    return KVOffloadStore(root, identity, max_bytes, **kw)


def _written(store: KVOffloadStore, items: dict[int, bytes]) -> None:
    for h, payload in items.items():
        assert store.put(h, payload, block=True)
    store.flush()


def test_round_trip_and_stats(tmp_path):
    store = _store(tmp_path, payload_bytes=100)
    blocks = {hash_block_tokens(None, [i] * 16): os.urandom(100) for i in range(5)}
    _written(store, blocks)
    for h, payload in blocks.items():
        assert store.read(h) == payload
    assert store.read(12345) is None  # never written: a miss
    s = store.stats_snapshot()
    assert (s.blocks_written, s.blocks_read, s.corrupt_files) == (5, 5, 0)
    assert s.bytes_written == 5 * (HEADER.size + 100)
    store.close()
    # a new store (another process, later) on the same directory and identity reads them
    again = _store(tmp_path, payload_bytes=100)
    assert all(again.read(h) == p for h, p in blocks.items())
    again.close()


def test_another_namespace_reuses_nothing(tmp_path):
    store = _store(tmp_path)
    _written(store, {7: b"x" * 64})
    for other in (
        {**IDENTITY, "kv_cache_dtype": "int8"},
        {**IDENTITY, "model": "n"},
        {**IDENTITY, "block_size": 32},
    ):
        assert _store(tmp_path, other).read(7) is None
    assert store.read(7) == b"x" * 64  # and they did not delete ours


def test_truncated_and_flipped_files_are_detected_and_deleted(tmp_path):
    store = _store(tmp_path)
    _written(store, {1: b"a" * 256, 2: b"b" * 256, 3: b"c" * 256, 4: b"d" * 256})
    p1, p2, p3 = store.path(1), store.path(2), store.path(3)
    p1.write_bytes(p1.read_bytes()[:-10])  # truncated payload
    data = bytearray(p2.read_bytes())
    data[HEADER.size + 100] ^= 0x01  # one flipped bit in the payload
    p2.write_bytes(bytes(data))
    data = bytearray(p3.read_bytes())
    data[20] ^= 0x40  # in the header (the namespace)
    p3.write_bytes(bytes(data))
    for h, p in ((1, p1), (2, p2), (3, p3)):
        assert store.read(h) is None
        assert not p.exists()
    assert store.read(4) == b"d" * 256
    assert store.stats_snapshot().corrupt_files == 3
    store.path(4).write_bytes(b"")  # an empty file (a crash before any byte reached the disk)
    assert store.read(4) is None and not store.path(4).exists()


def test_wrong_payload_size_is_corrupt(tmp_path):
    _written(_store(tmp_path), {5: b"z" * 10})
    assert _store(tmp_path, payload_bytes=11).read(5) is None


def test_lru_bound_keeps_the_recently_read(tmp_path):
    size = HEADER.size + 1000
    store = _store(tmp_path, max_bytes=10 * size)
    _written(store, {h: bytes([h]) * 1000 for h in range(8)})
    old = time.time() - 100
    for h in range(8):  # written long ago, in order
        os.utime(store.path(h), (old + h, old + h))
    assert store.read(0) is not None  # touched: now the most recently used
    _written(store, {h: bytes([h]) * 1000 for h in range(8, 12)})
    files = list(tmp_path.rglob("*.kvb"))
    assert sum(f.stat().st_size for f in files) <= 10 * size
    assert store.path(0).exists() and store.path(11).exists()
    assert not store.path(1).exists()  # the least recently used went first
    assert store.stats_snapshot().files_evicted >= 2


def test_full_queue_drops_and_counts(tmp_path):
    store = _store(tmp_path, queue_blocks=1)
    results = [store.put(h, b"p" * 100_000) for h in range(50)]  # far faster than the writer
    store.flush()
    drops = store.stats_snapshot().write_drops
    assert drops == results.count(False) and drops > 0


def test_two_stores_share_a_directory(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    _written(a, {h: b"A" * 500 for h in range(10)})
    _written(b, {h: b"B" * 500 for h in range(5, 15)})  # 5..9 already there: kept, touched
    assert all(b.read(h) == b"A" * 500 for h in range(10))
    assert all(a.read(h) == b"B" * 500 for h in range(10, 15))
    os.unlink(a.path(3))  # the other server's LRU deleted it: just a miss
    assert b.read(3) is None


def test_two_processes_write_the_same_blocks(tmp_path):
    code = (
        "import sys; from pagedllm.core.kv_offload import KVOffloadStore\n"
        f"s = KVOffloadStore(sys.argv[1], {IDENTITY!r}, 1 << 24)\n"
        "[s.put(h, bytes([h % 251]) * 4096, block=True) for h in range(200)]\n"
        "s.close()\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)]) for _ in range(2)]
    assert all(p.wait(60) == 0 for p in procs)
    store = _store(tmp_path, max_bytes=1 << 24)
    assert all(store.read(h) == bytes([h % 251]) * 4096 for h in range(200))
    assert not list(tmp_path.rglob("*.tmp"))


def test_block_hash_is_stable_across_processes():
    code = (
        "from pagedllm.core.block_pool import hash_block_tokens as h; print(h(h(None, [1, 2]), [3, 4], 'a'))"
    )
    out = {subprocess.check_output([sys.executable, "-c", code], text=True).strip() for _ in range(2)}
    assert out == {str(hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4], "a"))}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "fp8"])
def test_kv_transfer_round_trip(kind):
    from pagedllm.attention.kv_quant import QuantizedKVCache
    from pagedllm.planner import kv_bytes_per_token
    from pagedllm.worker import kv_transfer

    layers, blocks, bs, kvh, hd = 3, 6, 4, 2, 8
    if kind in ("int8", "fp8"):
        caches = [QuantizedKVCache.zeros(kind, blocks, bs, kvh, hd) for _ in range(layers)]
        for c in caches:
            c.raw.copy_(torch.randint(0, 100, c.raw.shape, dtype=torch.uint8).view(c.raw.dtype))
            c.scale.copy_(torch.rand(c.scale.shape))
        expected_bytes = 2 * layers * kvh * (hd + 4) * bs
    else:
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        caches = [torch.randn(2, blocks, bs, kvh, hd).to(dtype) for _ in range(layers)]
        expected_bytes = kv_bytes_per_token(layers, kvh * hd, kind) * bs
    assert kv_transfer.block_bytes(caches) == expected_bytes  # what the engine tells the store to expect
    saved = kv_transfer.save_blocks(caches, [4, 1])
    assert [len(p) for p in saved] == [expected_bytes] * 2

    def state(block) -> list[torch.Tensor]:
        if isinstance(caches[0], QuantizedKVCache):
            return [t for c in caches for t in (c.raw[:, block].clone(), c.scale[:, block].clone())]
        return [c[:, block].clone() for c in caches]

    before4, before1 = state(4), state(1)
    kv_transfer.load_blocks(caches, [(0, saved[0]), (5, saved[1])])
    assert all(torch.equal(a, b) for a, b in zip(state(0), before4))
    assert all(torch.equal(a, b) for a, b in zip(state(5), before1))
    assert not torch.equal(state(0)[0], state(1)[0])
