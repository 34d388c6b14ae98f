"""KVOffloadStore: full KV blocks on disk, named by the prefix cache's chained block hash (--kv-offload-dir).

A block evicted from the pool (or still cached when the engine shuts down) is written here; an engine
started later on the same directory reads the longest run of a prompt's next blocks back instead of
recomputing them (core/kv_cache_manager.py decides, the worker copies the bytes in and out of the paged
cache: worker/kv_transfer.py). The store only knows bytes: no torch here.

Layout: DIR/<namespace>/<hh>/<hash>.kvb, one file per block. The namespace is a digest of everything that
makes a block's bytes mean something (the model file's identity, KV dtype, block size, layers, KV heads and
head size): another model or KV dtype on the same directory finds nothing of ours, and never reads it.

A file is a fixed header (magic, namespace, block hash, payload length, crc32 of the payload) then the
payload. Written to a temporary name and os.replace'd, so a reader sees a whole file or none; a file that
is still wrong (torn by a crash before the data reached the disk, truncated, a flipped bit) fails its
header or checksum, is deleted and reads as a miss: the block is recomputed, never read into the cache.

Writes never block a step: put() hands the bytes to a writer thread through a bounded queue and drops them
(counted) when it is full. The directory is bounded by max_bytes over all namespaces: past it the writer
deletes the least recently used files (mtime: a read touches its file). Two servers may share a
directory: renames are atomic, and a file that vanishes under us (the other's LRU) is just a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("pagedllm")

MAGIC = b"PLKVBLK1"
# magic, namespace digest, block hash (signed 64-bit), payload length, crc32 of the payload
HEADER = struct.Struct("<8s16sqQI")
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
LOW_WATER = 0.9  # an eviction pass deletes down to this fraction of max_bytes, so it does not run per write
STALE_TMP_S = 3600.0  # a temporary file this old was left by a crashed writer
DEFAULT_QUEUE_BLOCKS = 256


def namespace_digest(identity: Mapping[str, object]) -> bytes:
    """16 bytes naming what a block's bytes depend on (model identity, KV dtype, block and head shapes)."""
    text = json.dumps(dict(identity), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def file_identity(path: str | os.PathLike) -> dict[str, object]:
    """A weights file's (or folder's) identity without reading it whole: resolved path, size and mtime of
    every file in it. A rewritten model gets a new mtime, so its old blocks are never reused."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return {
        "path": str(p),
        "files": [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files],
    }


def hash_hex(block_hash: int) -> str:
    return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


@dataclass
class KVOffloadStats:
    """Running totals of one store (this process's reads and writes)."""

    blocks_read: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    write_drops: int = 0  # writes dropped: the queue was full (the step never waits for the disk)
    corrupt_files: int = 0  # files that failed their header or checksum, deleted
    files_evicted: int = 0  # deleted by the LRU bound


class KVOffloadStore:
    def __init__(
        self,
        root: str | os.PathLike,
        identity: Mapping[str, object],
        max_bytes: int,
        payload_bytes: int | None = None,
        queue_blocks: int = DEFAULT_QUEUE_BLOCKS,
    ):
        """identity: what names the namespace (namespace_digest); payload_bytes: every block's size when
        known (a file of another size is corrupt); queue_blocks: blocks waiting for the writer at most."""
        if max_bytes < 1:
            raise ValueError(f"kv_offload_max_bytes must be at least 1, got {max_bytes}")
        self.root = Path(root)
        self.namespace = namespace_digest(identity)
        self.dir = self.root / self.namespace.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.payload_bytes = payload_bytes
        self.stats = KVOffloadStats()
        # hashes this process knows to be on disk (written or read here): not copied out again on eviction.
        # Another server's LRU may delete one meanwhile; then that block is only not written twice.
        self.known: set[int] = set()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max(1, queue_blocks))
        self._disk_bytes: int | None = None  # the directory's size as the writer last counted it
        self._lock = threading.Lock()  # stats are bumped by the writer and read by the engine
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    # -- names -----------------------------------------------------------------------------------------

    def path(self, block_hash: int) -> Path:
        name = hash_hex(block_hash)
        return self.dir / name[:2] / (name + SUFFIX)

    def contains(self, block_hash: int) -> bool:
        return self.path(block_hash).is_file()

    # -- reading (on the engine's thread) ----------------------------------------------------------------

    def read(self, block_hash: int) -> bytes | None:
        """The block's payload, or None when it is absent or bad (a bad file is deleted). Touches it (LRU)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as e:
            logger.warning("kv offload: cannot read %s: %s", path, e)
            return None
        payload = self._check(data, block_hash)
        if payload is None:
            with self._lock:
                self.stats.corrupt_files += 1
            logger.warning("kv offload: %s is truncated or corrupt: deleted, the block is recomputed", path)
            _unlink(path)
            self.known.discard(block_hash)
            return None
        try:
            os.utime(path)  # recently used: the last the LRU bound deletes
        except OSError:
            pass
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += len(payload)
        self.known.add(block_hash)
        return payload

    def _check(self, data: bytes, block_hash: int) -> bytes | None:
        if len(data) < HEADER.size:
            return None
        magic, namespace, stored_hash, length, crc = HEADER.unpack_from(data)
        payload = data[HEADER.size :]
        if (
            magic != MAGIC
            or namespace != self.namespace
            or stored_hash != block_hash
            or length != len(payload)
            or (self.payload_bytes is not None and length != self.payload_bytes)
            or zlib.crc32(payload) != crc
        ):
            return None
        return payload

    # -- writing (the writer thread) ------------------------------------------------------------------

    def put(self, block_hash: int, payload: bytes, block: bool = False) -> bool:
        """Queue a block for writing. Never waits unless block=True (shutdown): False, counted, when full."""
        if self._closed:
            return False
        try:
            self._queue.put((block_hash, payload), block=block)
        except queue.Full:
            with self._lock:
                self.stats.write_drops += 1
            return False
        self.known.add(block_hash)  # queued: the next eviction of this hash need not copy it out again
        return True

    def flush(self) -> None:
        """Wait until every queued block is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full disk, a vanished directory: lose this block, keep serving
                logger.exception("kv offload: writing a block failed")
            finally:
                self._queue.task_done()

    def _write(self, block_hash: int, payload: bytes) -> None:
        size = HEADER.size + len(payload)
        if size > self.max_bytes:
            return
        path = self.path(block_hash)
        if path.is_file():  # another server wrote it: touch, keep
            try:
                os.utime(path)
                return
            except FileNotFoundError:
                pass
        if self._disk_bytes is None:
            self._disk_bytes = self._scan_size()
        path.parent.mkdir(parents=True, exist_ok=True)
        header = HEADER.pack(MAGIC, self.namespace, block_hash, len(payload), zlib.crc32(payload))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)  # atomic: readers see the whole file or none
        with self._lock:
            self.stats.blocks_written += 1
            self.stats.bytes_written += size
        self._disk_bytes += size
        if self._disk_bytes > self.max_bytes:
            self._evict_lru()

    # -- the bound -------------------------------------------------------------------------------------

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file under root, all namespaces; stale temporaries deleted."""
        out = []
        now = time.time()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                if name.endswith(SUFFIX):
                    out.append((st.st_mtime, st.st_size, p))
                elif name.endswith(TMP_SUFFIX) and now - st.st_mtime > STALE_TMP_S:
                    _unlink(p)
        return out

    def _scan_size(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _evict_lru(self) -> None:
        """Delete the least recently used files (any namespace) until the directory is under LOW_WATER of
        max_bytes. Counted afresh each time: another server may have written or deleted meanwhile."""
        files = sorted(self._files(), key=lambda f: f[0])
        total = sum(size for _, size, _ in files)
        target = int(self.max_bytes * LOW_WATER)
        for _, size, p in files:
            if total <= target:
                break
            if _unlink(p):
                with self._lock:
                    self.stats.files_evicted += 1
                if p.parent.parent == self.dir:
                    self.known.discard(_hash_of(p.stem))
            total -= size
        self._disk_bytes = total

    def disk_bytes(self) -> int:
        """The directory's size now (all namespaces), counted."""
        return self._scan_size()

    def stats_snapshot(self) -> KVOffloadStats:
        with self._lock:
            return KVOffloadStats(**vars(self.stats))


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:  # the other server got there first
        return False


def _hash_of(stem: str) -> int | None:
    """The signed block hash a file name's 16 hex digits stand for (hash_hex's inverse)."""
    try:
        h = int(stem, 16)
    except ValueError:
        return None
    return h - (1 << 64) if h >= 1 << 63 else h
