"""Pinning torch's OpenMP threads one to a core (OMP_PROC_BIND=close, OMP_PLACES=cores), on request.

PAGEDLLM_CPU_BIND=cores pins them; "off" (the default) leaves them to the kernel's scheduler. Why not by
default: measured on a 2-core AMD EPYC (Zen 4) VM, 1B Q4_K_M single50 decode at 2 threads, `pagedllm
bench throughput` one run after the other on a quiet machine: unpinned 40.4 tok/s, pinned 41.1, pinned with
the main thread freed again (what this module does) 38.1: within the run-to-run noise (~10%), so no gain
here, and pinning is a hazard wherever several processes share the cores (two engines, data-parallel
replicas given a few threads each: each would pin to the same first cores). On a big many-core host one
engine a socket, pinning may pay; the option is there to measure it.

libgomp reads the variables once, when torch loads it, so this runs before the first `import torch` of the
process (the CLI's main does, before the command runs; an application that imports torch itself sets
OMP_PROC_BIND / OMP_PLACES itself). Where the user set any of OpenMP's binding variables, theirs rule. The
variables are removed from the environment once torch has read them, so that child processes (tensor-
parallel workers, Ray replicas) start unpinned, and the main thread's own mask is restored (libgomp pins it
to the first core; every thread and process it starts would inherit that one core).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from pagedllm.errors import InputError

logger = logging.getLogger("pagedllm")

# OpenMP's binding variables (GNU, Intel): where the user set any, theirs rule
USER_BINDING = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
PINNED = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
MODES = ("off", "cores")


def binding(env: Mapping[str, str]) -> dict[str, str] | None:
    """The variables to set (None: leave the threads unpinned)."""
    mode = env.get("PAGEDLLM_CPU_BIND", "off")
    if mode not in MODES:
        raise InputError(
            f"PAGEDLLM_CPU_BIND must be one of {', '.join(MODES)}, got {mode!r}", param="PAGEDLLM_CPU_BIND"
        )
    if mode == "off" or any(k in env for k in USER_BINDING):
        return None
    return dict(PINNED)


def apply() -> bool:
    """Pin (PAGEDLLM_CPU_BIND=cores) and import torch; False where the threads stay unpinned (or torch is
    already loaded: too late to ask libgomp)."""
    env = binding(os.environ)
    if env is None or "torch" in sys.modules:
        return False
    cpus = os.sched_getaffinity(0)
    os.environ.update(env)
    try:
        import torch  # noqa: F401 - loads libgomp, which reads the variables now
    finally:
        for key in env:
            os.environ.pop(key, None)  # children (TP workers, Ray replicas) decide for themselves
    # libgomp has bound this (the initial) thread to the first core; free it again: every thread and
    # process it starts (llama-server in a benchmark, tensor-parallel workers, tokenizer pools) inherits
    # its mask, and must not be confined to one core. The pool's other threads keep their cores.
    os.sched_setaffinity(0, cpus)
    logger.info("CPU threads pinned one to a core (PAGEDLLM_CPU_BIND=cores)")
    return True
