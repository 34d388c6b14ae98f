"""--kv-offload-dir with the real default model (issue 38 item 2): a ~1,700-token prompt's blocks outlive the
engine, a second engine on the same directory reads them back (cached tokens, same greedy output), another KV
dtype reuses nothing, a corrupted block file is detected and recomputed. Offline engines, one at a time."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams

BLOCK = 16


def long_prompt(topic: str) -> str:
    return " ".join(
        f"Note {i} on {topic}: the quick brown fox jumps over the lazy dog by the river." for i in range(90)
    )


def engine(tmp_path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)  # one long prompt fits, two do not: the second evicts the first
    return LLMEngine(model="default", show_progress=False, kv_offload_dir=str(tmp_path), **kw)


def run(e: LLMEngine, prompt: str, rid: str):
    e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            final = out
    return final


def test_offload_round_trip_namespaces_and_corruption(tmp_path):
    a, b = long_prompt("rivers"), long_prompt("mountains")

    first = engine(tmp_path)
    out_a = run(first, a, "a")
    n = len(out_a.prompt_token_ids)
    assert n >= 1500 and out_a.num_cached_tokens == 0
    out_b = run(first, b, "b")  # needs most of the pool: evicts a's blocks, which go to disk
    first.kv_offloader.store.flush()
    assert first.get_stats().kv_offload.store.blocks_written > 0
    first.shutdown()  # and every block still cached (b's)

    second = engine(tmp_path)
    again = run(second, a, "a2")
    assert again.num_cached_tokens >= 1400
    assert again.outputs[0].token_ids == out_a.outputs[0].token_ids
    stats = second.get_stats()
    assert stats.kv_offload.hits == again.num_cached_tokens  # read from disk, not the (empty) prefix cache
    assert stats.kv_offload.store.blocks_read == again.num_cached_tokens // BLOCK

    # a flipped byte in b's block 50: blocks 0..49 are read, 50 is deleted and from there on recomputed
    store = second.kv_offloader.store
    ids = out_b.prompt_token_ids
    h = None
    for i in range(51):
        h = hash_block_tokens(h, ids[i * BLOCK : (i + 1) * BLOCK])
    path = store.path(h)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    out = run(second, b, "b2")
    assert out.num_cached_tokens == 50 * BLOCK
    assert out.outputs[0].token_ids == out_b.outputs[0].token_ids
    assert store.stats_snapshot().corrupt_files == 1 and not path.exists()
    second.shutdown()
    assert path.exists()  # recomputed, and written again at shutdown

    # another KV dtype on the same directory: a namespace of its own, nothing reused (a's first 40 blocks)
    other = engine(tmp_path, kv_cache_dtype="int8")
    assert run(other, out_a.prompt_token_ids[: 40 * BLOCK + 1], "a3").num_cached_tokens == 0
    assert other.get_stats().kv_offload.hits == 0
    other.shutdown()


def test_refused_options(tmp_path):
    with pytest.raises(InputError, match="kv_offload_dir"):
        engine(tmp_path, enable_prefix_caching=False)
    with pytest.raises(InputError, match="kv_offload_dir"):
        engine(tmp_path, tensor_parallel_size=2)
    with pytest.raises(InputError, match="kv_offload_max_bytes"):
        LLMEngine(model="default", show_progress=False, kv_offload_max_bytes="1GiB")
