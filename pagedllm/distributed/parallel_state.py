"""The tensor-parallel group of this process and its collectives (torch.distributed: gloo on CPU, nccl on CUDA).

One process per rank. Rank 0 is the engine's own process; ranks 1..N-1 are worker processes the engine
starts (executor/multiproc.py). Without `init_tensor_parallel` the world is one rank and every
collective returns its input untouched, so the single-process engine pays a function call for them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_tp_size = 1
_tp_rank = 0


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: str = "cpu", timeout_s: float = 120.0
):
    """Join the group of `world_size` ranks at `init_method` (a tcp:// address on loopback)."""
    global _tp_size, _tp_rank
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _tp_size, _tp_rank = world_size, rank


def destroy_tensor_parallel() -> None:
    global _tp_size, _tp_rank
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_size, _tp_rank = 1, 0


def tp_size() -> int:
    return _tp_size


def tp_rank() -> int:
    return _tp_rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x (a row-parallel layer's partial products), in place."""
    if _tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x, equal shapes, concatenated along dim in rank order (vocabulary-parallel logits)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
