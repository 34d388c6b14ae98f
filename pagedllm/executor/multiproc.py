"""Tensor parallelism over N worker processes on this machine (torch.distributed: gloo on CPU).

The engine keeps the scheduler, the sampler's grammar masks and the detokenizer; each step's plain-data
SchedulerOutput is pickled down a pipe to every rank, and rank 0 answers with the sampled tokens. The
engine waits on rank 0's answer and on every worker's process sentinel together, so a worker that dies
ends the engine with an error naming it within moments (the surviving ranks' collectives fail at once
too, gloo noticing the closed connection), never a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.worker import WorkerConfig

logger = logging.getLogger("pagedllm")
START_TIMEOUT_S = 600.0  # loading and sharding a model, kernels cached


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker ended or failed: the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_worker(rank: int) -> tuple[subprocess.Popen, Connection]:
    """`python -m pagedllm.executor.worker` with one end of a socket pair: a fresh interpreter that never
    re-runs the user's script (multiprocessing's spawn would), and whose death closes the pipe."""
    parent, child = socket.socketpair()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the pagedllm this process imported, first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.executor.worker", str(rank), str(child.fileno())],
        pass_fds=[child.fileno()],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    child.close()
    return proc, Connection(parent.detach())


class MultiprocExecutor:
    def __init__(self, config: WorkerConfig):
        self.tp_size = config.tp_size
        config = replace(
            config,
            num_threads=config.num_threads or default_threads(config.tp_size),
            init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        for rank in range(self.tp_size):
            proc, conn = _start_worker(rank)
            self.procs.append(proc)
            self.conns.append(conn)
            conn.send(config)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._receive(set(range(self.tp_size)), START_TIMEOUT_S, "starting")
        logger.info("tensor parallel: %d worker processes ready (pids %s)", self.tp_size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _receive(self, ranks: set[int], timeout: float | None, doing: str) -> dict[int, object]:
        """One message from each rank in `ranks`; WorkerDiedError as soon as any worker reports an error,
        speaks unasked, or ends (its end of the pipe closes with it)."""
        got: dict[int, object] = {}
        while len(got) < len(ranks):
            ready = wait([c for r, c in enumerate(self.conns) if r not in got], timeout)
            if not ready:
                self._fail(f"tensor-parallel workers gave no answer in {timeout:.0f} s while {doing}")
            problems = []
            for conn in ready:
                r = self.conns.index(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "error", self._death(r)
                if kind == "error":
                    problems.append(payload)
                elif r not in ranks:
                    problems.append(f"rank {r} sent {kind!r} unasked")
                else:
                    got[r] = payload
            if problems:
                self._fail(f"tensor-parallel worker failed while {doing}: " + "; ".join(problems))
        return got

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        try:
            code = proc.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        return f"rank {rank} (pid {proc.pid}) died (exit code {code})"

    def _fail(self, message: str):
        self.shutdown()
        raise WorkerDiedError(message)

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_bitmask=None):
        if self._closed:
            raise WorkerDiedError("the tensor-parallel workers were shut down")
        message = (scheduler_output, grammar_bitmask)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:  # a dead worker's pipe: name it
                self._fail(f"tensor-parallel worker failed while receiving a step: {self._death(rank)}")
        return self._receive({0}, None, "running a step")[0]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(1)
    for conn in conns:
        conn.close()


def default_threads(tp_size: int) -> int:
    """Each rank's torch threads: this process's share out (2 threads, 2 ranks: one each)."""
    return max(1, torch.get_num_threads() // tp_size)
