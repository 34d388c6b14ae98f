"""The engine's side of --kv-offload-dir: opens the disk store, feeds it each step's copied-out blocks, and
writes every cached block at shutdown (the store and its format: core/kv_offload.py; the copies:
worker/kv_transfer.py; which blocks: core/kv_cache_manager.py)."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from dataclasses import dataclass

from pagedllm.core.kv_offload import KVOffloadStats, KVOffloadStore, file_identity
from pagedllm.errors import InputError
from pagedllm.units import parse_size

logger = logging.getLogger("pagedllm")

DEFAULT_MAX_BYTES = "10GiB"
FORMAT_VERSION = 1  # bump when a block's byte layout changes: old files then belong to another namespace
SHUTDOWN_CHUNK_BLOCKS = 64  # blocks copied out at once at shutdown (bounds the memory the copy takes)


@dataclass
class KVOffloadEngineStats:
    """What /metrics reports: the lookups (tokens) and the store's reads and writes."""

    queries: int  # prompt tokens looked up on disk after a prefix-cache miss
    hits: int  # of those, tokens read from disk
    store: KVOffloadStats


def check_kv_offload_options(
    kv_offload_dir: str | None,
    kv_offload_max_bytes: int | str | None,
    enable_prefix_caching: bool,
    tensor_parallel_size: int,
    speculative_method: str | None,
) -> int | None:
    """The byte bound (None when offload is off); InputError naming the option that cannot go with it."""
    if kv_offload_dir is None:
        if kv_offload_max_bytes is not None:
            raise InputError("kv_offload_max_bytes needs kv_offload_dir", param="kv_offload_max_bytes")
        return None
    max_bytes = parse_size(
        kv_offload_max_bytes if kv_offload_max_bytes is not None else DEFAULT_MAX_BYTES,
        param="kv_offload_max_bytes",
    )
    if max_bytes < 1:
        raise InputError("kv_offload_max_bytes must be positive", param="kv_offload_max_bytes")
    if not enable_prefix_caching:
        raise InputError(
            "kv_offload_dir keeps the prefix cache's blocks: it needs prefix caching (drop --no-prefix-caching)",
            param="kv_offload_dir",
        )
    if tensor_parallel_size > 1:
        raise InputError(
            "kv_offload_dir is not supported with tensor_parallel_size > 1 (each rank holds a share of "
            "every block)",
            param="kv_offload_dir",
        )
    if speculative_method == "draft_model":
        raise InputError(
            "kv_offload_dir is not supported with a draft model (its own KV blocks are not offloaded)",
            param="kv_offload_dir",
        )
    if os.path.exists(kv_offload_dir) and not os.path.isdir(kv_offload_dir):
        raise InputError(f"kv_offload_dir {kv_offload_dir!r} is not a directory", param="kv_offload_dir")
    return max_bytes


def open_store(
    kv_offload_dir: str,
    max_bytes: int,
    model_path: str | os.PathLike,
    *,
    quantization: str | None,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    batch_invariant: bool,
    block_bytes: int,
) -> KVOffloadStore:
    """The store, its namespace naming everything a block's bytes depend on."""
    identity = {
        "format": FORMAT_VERSION,
        "model": file_identity(model_path),
        "quantization": quantization,
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": block_size,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "batch_invariant": batch_invariant,
    }
    store = KVOffloadStore(kv_offload_dir, identity, max_bytes, payload_bytes=block_bytes)
    logger.info(
        "KV offload: %s (namespace %s), at most %d bytes", kv_offload_dir, store.namespace.hex(), max_bytes
    )
    return store


class KVOffloader:
    """Owns the store for one engine: queue each step's saved blocks; write the rest at shutdown."""

    def __init__(self, store: KVOffloadStore):
        self.store = store
        self.closed = False

    def after_step(self, sched_out, runner_out) -> None:
        """Queue the blocks this step copied out (never waits: the store drops them when its queue is full)."""
        for (_, block_hash), payload in zip(sched_out.kv_blocks_to_save, runner_out.kv_saved):
            self.store.put(block_hash, payload)

    def shutdown(self, scheduler, executor) -> None:
        """Copy out every cached block the disk lacks, write it (waiting now: the engine is stopping), and
        stop the writer. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            pending = scheduler.kv_cache_manager.cached_blocks_not_offloaded()
            for i in range(0, len(pending), SHUTDOWN_CHUNK_BLOCKS):
                step = scheduler.runner_sync.build([], {})
                step.kv_blocks_to_save = pending[i : i + SHUTDOWN_CHUNK_BLOCKS]
                out = executor.execute_model(step)
                for (_, block_hash), payload in zip(step.kv_blocks_to_save, out.kv_saved):
                    self.store.put(block_hash, payload, block=True)
            logger.info("KV offload: %d cached blocks written at shutdown", len(pending))
        finally:
            self.store.close()

    def register_atexit(self, engine) -> None:
        """An offline engine nobody shuts down still writes its cache when the interpreter exits."""
        ref = weakref.ref(engine)

        def flush() -> None:
            e = ref()
            if e is not None and not self.closed:
                try:
                    e.shutdown()
                except Exception:
                    logger.exception("KV offload: writing the cache at exit failed")

        atexit.register(flush)

    def stats(self, kv_cache_manager) -> KVOffloadEngineStats:
        s = kv_cache_manager.offload_lookup_stats
        return KVOffloadEngineStats(s.queries, s.hits, self.store.stats_snapshot())
