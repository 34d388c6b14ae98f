"""A tensor-parallel worker process: builds its rank's share of the model, then runs the steps it is sent.

Every rank runs the same ModelRunner code on the same plain-data step; the collectives inside the model
(all-reduce after o and down, all-gather of the logits) keep them in lockstep. Rank 0 samples and sends
its ModelRunnerOutput back; the others send nothing per step. A worker ends when the engine sends None,
when the engine's end of its pipe closes, or when a step fails (a peer died: gloo says so at once); it
then reports the error, so the engine can end with it instead of waiting.
"""

from __future__ import annotations

import logging
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pagedllm import ops
from pagedllm.config import CacheConfig
from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedllm.lora.manager import LoRAModelManager
from pagedllm.lora.request import LoRAConfig
from pagedllm.model.build import load_model_for_inference
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass
class WorkerConfig:
    """All an executor needs to build its model runner (or a worker its rank's): picklable."""

    model_path: str
    dtype: torch.dtype
    quantization: str | None
    cache_config: CacheConfig
    tp_size: int = 1
    seed: int = 0
    num_threads: int = 0  # each rank's torch threads (MultiprocExecutor sets them)
    init_method: str = ""  # tcp://127.0.0.1:PORT, where the ranks meet (MultiprocExecutor sets it)
    batch_invariant: bool = False  # --batch-invariant: the model built under ops.batch_invariant(), run so
    lora_config: LoRAConfig | None = None  # --enable-lora: the model's linears take adapters (pagedllm/lora)


def make_runner(config: WorkerConfig, rank: int = 0, show_progress: bool = False) -> ModelRunner:
    """Rank `rank`'s model runner: its share of the model, loaded for inference, and its KV cache. The
    same code on every rank and in the engine's own process (tp_size 1), so a step, verify rows of draft
    tokens included, is prepared and run alike everywhere; only rank 0 samples."""
    with ops.batch_invariant() if config.batch_invariant else nullcontext():
        model, local_config = load_model_for_inference(
            config.model_path,
            config.dtype,
            config.quantization,
            tp_rank=rank,
            tp_size=config.tp_size,
            show_progress=show_progress,
        )
    runner = ModelRunner(
        model,
        local_config,
        config.cache_config,
        config.dtype,
        samples=rank == 0,
        batch_invariant=config.batch_invariant,
    )
    if config.lora_config is not None:
        runner.lora = LoRAModelManager(model, local_config, config.lora_config, config.dtype)
    return runner


def run_worker(rank: int, config: WorkerConfig, conn: Connection) -> None:
    """The worker process's main function."""
    try:
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        init_tensor_parallel(rank, config.tp_size, config.init_method)
        ops.table()
        runner = make_runner(config, rank)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", f"rank {rank} failed to start: {e!r}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the engine is gone
                break
            if message is None:
                break
            scheduler_output, grammar_bitmask = message
            try:
                out = runner.execute_model(scheduler_output, grammar_bitmask)
            except Exception as e:  # noqa: BLE001
                conn.send(("error", f"rank {rank}: {e!r}"))
                break
            if rank == 0:
                conn.send(("ok", out))
    finally:
        destroy_tensor_parallel()


def main(argv: list[str]) -> None:
    """`python -m pagedllm.executor.worker RANK FD`: FD is this worker's end of the engine's socket pair;
    the first message on it is the WorkerConfig."""
    logging.basicConfig(level=logging.WARNING, format=f"rank {argv[0]} %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(argv[1]))
    try:
        config = conn.recv()
    except EOFError:
        return
    run_worker(int(argv[0]), config, conn)


if __name__ == "__main__":
    main(sys.argv[1:])
