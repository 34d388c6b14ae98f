"""`pagedllm build-kernels`: compile every C++ kernel for this machine's tier now, not at first use."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedllm import kernels, platform


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build-kernels",
        help="compile the C++ CPU kernels for this machine now (else the first engine start does it)",
        description="Compile every C++ kernel this machine's tier uses into the kernel cache "
        "(~/.cache/pagedllm/kernels, or PAGEDLLM_KERNEL_CACHE), keyed by source, flags, tier and torch "
        "version. A second run finds them built and returns at once.",
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    tier = platform.capabilities().tier
    failed = []
    for name in kernels.KERNELS:
        before = kernels.state(name)
        if before.startswith("not for"):
            print(f"{name:<14} skipped: {before}", flush=True)
            continue
        start = time.perf_counter()
        ok = kernels.load(name) is not None
        took = time.perf_counter() - start
        print(
            f"{name:<14} {'built' if ok else 'FAILED'} for {tier}"
            + (f" in {took:.0f} s" if before != "built" else " (cached)"),
            flush=True,
        )
        if not ok:
            failed.append(name)
    if failed:
        sys.stderr.write(
            f"pagedllm build-kernels: {', '.join(failed)} did not build (see the warnings above)\n"
        )
        return 1
    return 0
