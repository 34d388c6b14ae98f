"""The model runner in the engine's own process: a step is a method call (the default, nothing to pay)."""

from __future__ import annotations

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput


class UniProcExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        pass
