"""The packed kernel layouts of a big GGUF file, kept on disk so that the next load reads them instead of
decoding and repacking every block (llama.cpp maps its file and starts in about a second; decoding and
packing a 1B Q4_K_M file takes ~10 s on two cores, an 8B one ~50 s).

    ~/.cache/pagedllm/layouts/<file stem>-<variant>-<sources>.pt
    (PAGEDLLM_LAYOUT_CACHE moves the root; "off" turns the cache off)

One file per model file, activation dtype and kernel backend: a torch.save'd dict {module name: (kernel name,
layout tensors, shape facts)}, read back whole with torch.load: not mapped, because fusing q / k / v and
gate / up copies most layouts into joined ones, and a mapped file's pages read for that copy would stay in
the process's resident set beside it (a private read is one copy, freed part by part). The key covers the
GGUF's identity (path, size, mtime), the dtype, the op table's backend, the CPU tier, --batch-invariant, and
the source of every file that decides a layout: an edit to a packer or a decoder makes a new key, so a
stale layout is never read (and saving a variant's new file removes its files of older sources). A
file that does not load or does not match what the loader expects is ignored (and rebuilt); it is written
to a temporary name and renamed, so a crash never leaves a torn one. Only files of at least MIN_FILE_BYTES
are cached: a small model repacks in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from pagedllm import ops, platform
from pagedllm.quantization import woq_kernels
from pagedllm.quantization.linear import QuantLinear

logger = logging.getLogger(__name__)

CACHE_ENV = "PAGEDLLM_LAYOUT_CACHE"
MIN_FILE_BYTES = 256 << 20
FORMAT = 1
_PACKAGE = Path(__file__).resolve().parent
# What decides a layout: the block decoders, the packers and the kernels' choice. Not the C++ kernels: they
# only read what these write (a kernel that reads a new layout comes with its packer's change, or bumps
# FORMAT), and a kernel edit that forced a repack cost every 1B model 95-170 s on its next load.
_SOURCES = ("gguf_blocks.py", "gguf_native.py", "avx2.py", "amx.py", "scale_forms.py", "pack.py", "woq_kernels.py", "linear.py")


def cache_root() -> Path | None:
    root = os.environ.get(CACHE_ENV, "").strip()
    if root.lower() in ("off", "0", "none"):
        return None
    return Path(root) if root else Path.home() / ".cache" / "pagedllm" / "layouts"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in (_PACKAGE / s for s in _SOURCES):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


# Taken once, when the packers are imported (woq_kernels above imports them): the digest of the code this
# process runs. Read at each load instead, a process that outlived an edit of a packer would file the old
# code's layouts under the new code's key, and every later process would read them as current.
SOURCE_DIGEST = _source_digest()


class LayoutCache:
    """The cached layouts of one GGUF file for one dtype and backend: get() on load, put() + save() once
    after a load that missed."""

    def __init__(self, path: Path, entries: dict | None, packed_for: tuple[torch.dtype, str]):
        self.path, self._entries, self._new, self.packed_for = path, entries or {}, {}, packed_for

    @classmethod
    def for_file(cls, gguf_path: Path, dtype: torch.dtype) -> LayoutCache | None:
        """The cache of `gguf_path`, its entries read when present; None where caching is off or the file
        is small."""
        root, stat = cache_root(), Path(gguf_path).stat()
        if root is None or stat.st_size < MIN_FILE_BYTES:
            return None
        variant = "|".join(
            map(
                str,
                (
                    FORMAT,
                    Path(gguf_path).resolve(),
                    stat.st_size,
                    stat.st_mtime_ns,
                    dtype,
                    ops.backend("quantized_linear"),
                    platform.capabilities().tier,
                    ops.building_batch_invariant(),
                ),
            )
        )
        # <stem>-<variant>-<sources>.pt: a file of this variant with other sources can never be read again,
        # so save() removes it
        path = root / f"{Path(gguf_path).stem}-{_digest(variant)}-{SOURCE_DIGEST[:12]}.pt"
        return cls(path, cls._read(path), (dtype, ops.backend("quantized_linear")))

    @staticmethod
    def _read(path: Path) -> dict | None:
        if not path.exists():
            return None
        try:
            entries = torch.load(path, weights_only=True)
        except Exception as e:  # a partial or foreign file: rebuilt and rewritten below
            logger.warning("layout cache %s is unreadable (%s); the layouts are rebuilt", path, e)
            return None
        logger.info("layout cache: %d packed layers read from %s", len(entries), path)
        return entries

    @property
    def complete(self) -> bool:
        return bool(self._entries)

    def get(self, name: str, shape: tuple[int, int], bias: torch.Tensor | None) -> QuantLinear | None:
        """The module's layer from its cached layout, or None (not cached, or not what `shape` says)."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        kernel = next((k for k in woq_kernels.candidates() if k.name == entry["kernel"]), None)
        if kernel is None or (entry["out_features"], entry["in_features"]) != tuple(shape):
            return None
        return QuantLinear.from_layout(
            kernel,
            tuple(entry["layout"]),
            entry["in_features"],
            entry["out_features"],
            entry["bits"],
            entry["group_size"],
            self.packed_for,
            bias,
            name,
        )

    def put(self, name: str, layer: QuantLinear) -> None:
        """Keep `layer`'s layout for save(), where its kernel's layout holds the whole weight."""
        kernel = layer.kernel
        if self.complete or kernel is None or not kernel.holds_weight or layer._packed_for != self.packed_for:
            return
        self._new[name] = {
            "kernel": layer.kernel.name,
            "layout": list(layer.layout),
            "in_features": layer.in_features,
            "out_features": layer.out_features,
            "bits": layer.bits,
            "group_size": layer.group_size,
        }

    def save(self) -> None:
        """Write what put() kept (once, after a load that found no cache); a failure only logs."""
        if not self._new:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self._new, tmp)
            os.replace(tmp, self.path)
            stem, variant, _ = self.path.stem.rsplit("-", 2)
            for stale in self.path.parent.glob(f"{stem}-{variant}-*.pt"):
                if stale != self.path:
                    stale.unlink(missing_ok=True)
            size = self.path.stat().st_size
            logger.info(
                "layout cache: wrote %d packed layers (%.0f MiB) to %s",
                len(self._new),
                size / 2**20,
                self.path,
            )
        except OSError as e:
            tmp.unlink(missing_ok=True)
            logger.warning("layout cache: could not write %s (%s)", self.path, e)
        self._new = {}
