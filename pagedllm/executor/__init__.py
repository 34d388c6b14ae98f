"""Where the model runs: in the engine's process (UniProcExecutor) or in tensor-parallel worker processes
(MultiprocExecutor). Both take a plain-data SchedulerOutput and return rank 0's ModelRunnerOutput."""
