"""The C++ decode kernel (csrc/paged_decode.cpp), compiled on first use with torch's extension loader.

It reads K/V in place through the block tables instead of gathering a padded copy of every context.
Building needs a C++ compiler and ninja; when either is missing, or PAGEDLLM_NO_CPU_KERNEL=1 is set,
paged attention falls back to the pure-torch path (the same results within float rounding).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@cache
def load():
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("PAGEDLLM_NO_CPU_KERNEL") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name="pagedllm_paged_decode",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, an unusual platform: the torch path still works
        logger.warning(
            "C++ paged decode kernel unavailable (%s); using the torch path", str(e).splitlines()[0]
        )
        return None
