"""Build a C++ CPU kernel file with torch's extension loader on first use (cached under
~/.cache/torch_extensions, so once a machine).

Building needs a C++ compiler and ninja; when either is missing, or PAGEDLLM_NO_CPU_KERNEL=1 is set,
callers get None and use their pure-torch path (the same results within float rounding).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("pagedllm")


def load_cpp_extension(name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("PAGEDLLM_NO_CPU_KERNEL") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, an unusual platform: the torch path still works
        logger.warning("C++ kernels %s unavailable (%s); using the torch path", name, str(e).splitlines()[0])
        return None
