"""The C++ decode kernel (csrc/paged_decode.cpp), compiled on first use (pagedllm/cpp_extension.py).

It reads K/V in place through the block tables instead of gathering a padded copy of every context,
and writes new K/V into the cache at their slots in one call.
"""

from __future__ import annotations

from pagedllm import kernels


def load():
    """The compiled module, or None when it cannot be built here."""
    return kernels.load("paged_decode")
