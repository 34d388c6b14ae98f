"""Build a C++ CPU kernel file with torch's extension loader, once per machine and tier.

Each build is compiled for one instruction-set tier (platform.py: the flags of that tier, never
-march=native) and lives in its own folder, keyed by the hash of the source and every project header it
includes, the flags, the tier and the torch version:
    ~/.cache/pagedllm/kernels/<name>_<tier>_<key>/       (PAGEDLLM_KERNEL_CACHE moves the root)
so two installs, two tiers or two torch builds never rebuild each other's objects. A build that has to
compile says so on stderr first ("compiling ... once"); `pagedllm build-kernels` builds them all ahead.

Building needs a C++ compiler and ninja; when either is missing, or PAGEDLLM_NO_CPU_KERNEL=1 is set,
callers get None and use their pure-torch path (the same results within float rounding).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pagedllm import platform

logger = logging.getLogger("pagedllm")

_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.MULTILINE)
BASE_CFLAGS = ("-O3", "-fopenmp")
# rough first-build cost of one extension on 2 cores, for the line that says a compile is happening
_SECONDS_PER_BUILD = 40


def local_headers(source: Path, seen: set[Path] | None = None) -> list[Path]:
    """The project headers a source includes ("..."), followed through their own includes."""
    seen = set() if seen is None else seen
    for name in _LOCAL_INCLUDE.findall(source.read_text()):
        header = (source.parent / name).resolve()
        if header.is_file() and header not in seen:
            seen.add(header)
            local_headers(header, seen)
    return sorted(seen)


def cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pagedllm" / "kernels"


def build_key(source: Path, flags: list[str], tier: str) -> str:
    """What a build depends on: source + headers, flags, tier, torch version."""
    import torch

    h = hashlib.sha256()
    for path in (source, *local_headers(source)):
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(tier.encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


def build_dir(name: str, source: Path, tier: str | None = None) -> tuple[Path, str, list[str]]:
    """(folder, module name, compiler flags) of `name` built for `tier` (default: this process's tier)."""
    tier = tier or platform.capabilities().tier
    flags = [*BASE_CFLAGS, *platform.cflags(tier)]
    key = build_key(source, flags, tier)
    module = f"{name}_{tier}_{key}"
    return cache_root() / module, module, flags


def is_built(name: str, source: Path, tier: str | None = None) -> bool:
    folder, module, _ = build_dir(name, source, tier)
    return (folder / f"{module}.so").is_file()


@contextmanager
def _build_lock(folder: Path):
    """Hold an flock on the build folder while torch builds or loads in it. torch's own `lock` file marks a
    build in progress, but a builder that was killed leaves it behind and every later process waits on it
    forever; an flock dies with its process. So whoever holds the flock knows no live builder of ours
    is in that folder, and removes a leftover `lock`."""
    with open(folder / ".pagedllm-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_cpp_extension(name: str, source: Path, extra_cflags: tuple[str, ...] = (), tier: str | None = None):
    """The compiled module for `tier` (default: this process's), or None when it cannot be built here."""
    if os.environ.get("PAGEDLLM_NO_CPU_KERNEL") == "1":
        return None
    tier = tier or platform.capabilities().tier  # a bad PAGEDLLM_CPU_ISA is the user's error: raised
    try:
        folder, module, flags = build_dir(name, source, tier)
        fresh = not (folder / f"{module}.so").is_file()
        if fresh:
            sys.stderr.write(
                f"pagedllm: compiling CPU kernels {name} for {tier} (about {_SECONDS_PER_BUILD} s, once; "
                f"cached in {folder})\n"
            )
            sys.stderr.flush()
        folder.mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load as load_extension

        start = time.perf_counter()
        with _build_lock(folder):
            ext = load_extension(
                name=module,
                sources=[str(source)],
                extra_cflags=[*flags, *extra_cflags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
        if fresh:
            logger.info("built %s for %s in %.0f s", name, tier, time.perf_counter() - start)
        return ext
    except Exception as e:  # no compiler, no ninja, an unusual platform: the torch path still works
        logger.warning("C++ kernels %s unavailable (%s); using the torch path", name, str(e).splitlines()[0])
        return None
