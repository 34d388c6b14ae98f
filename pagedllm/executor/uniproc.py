"""The model runner in the engine's own process: a step is a method call (the default, nothing to pay)."""

from __future__ import annotations

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.worker import WorkerConfig, make_runner
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput


class UniProcExecutor:
    def __init__(self, config: WorkerConfig, show_progress: bool = True):
        self.runner: ModelRunner = make_runner(config, show_progress=show_progress)

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        pass
