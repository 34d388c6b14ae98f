"""Build a C++ CPU kernel file with torch's extension loader on first use (cached under
~/.cache/torch_extensions, so once a machine).

Building needs a C++ compiler and ninja; when either is missing, or PAGEDLLM_NO_CPU_KERNEL=1 is set,
callers get None and use their pure-torch path (the same results within float rounding).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger("pagedllm")


_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.MULTILINE)


def local_headers(source: Path, seen: set[Path] | None = None) -> list[Path]:
    """The project headers a source includes ("..."), followed through their own includes."""
    seen = set() if seen is None else seen
    for name in _LOCAL_INCLUDE.findall(source.read_text()):
        header = (source.parent / name).resolve()
        if header.is_file() and header not in seen:
            seen.add(header)
            local_headers(header, seen)
    return sorted(seen)


def load_cpp_extension(name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("PAGEDLLM_NO_CPU_KERNEL") == "1":
        return None
    # torch rebuilds when the source or the flags change, not when a header does: the headers' hash goes
    # into the flags
    digest = hashlib.sha1(b"".join(h.read_bytes() for h in local_headers(source))).hexdigest()[:16]
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DPAGEDLLM_HEADERS={digest}", *extra_cflags],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, an unusual platform: the torch path still works
        logger.warning("C++ kernels %s unavailable (%s); using the torch path", name, str(e).splitlines()[0])
        return None
