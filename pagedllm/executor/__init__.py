"""Where the model runs: in the engine's process (UniProcExecutor) or in tensor-parallel worker processes
(MultiprocExecutor). Both take a plain-data SchedulerOutput and return rank 0's ModelRunnerOutput, so the
engine (its steps, speculative decoding's step-cost probe) never needs to know which one it has.

make_executor imports them when called: `python -m pagedllm.executor.worker` imports this package first,
and a package that imported the worker module would have runpy run it a second time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.executor.worker import WorkerConfig
    from pagedllm.worker.model_runner import ModelRunnerOutput


class Executor(Protocol):
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: tuple[list[str], torch.Tensor] | None = None,
    ) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


def make_executor(config: WorkerConfig, show_progress: bool = True) -> Executor:
    """The executor of config.tp_size ranks: the model loaded here for 1, else that many worker processes
    that each load their share (no weights in this process)."""
    if config.tp_size == 1:
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, show_progress)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
