"""AsyncPoolingEngine: the pooling engine behind the server, as AsyncEngine is the LLMEngine's.

One background thread runs the forwards. Requests arriving while a forward runs queue up, and the next
round takes every queued request of the same task at once, so concurrent clients' inputs share forwards
under the token budget (PoolingEngine.batches) instead of running one request after another.

It is an EngineClient (engine/protocol.py), so the server's common routes (/health, /metrics, /v1/models,
/tokenize) serve it as they serve a generative engine; the generating members refuse with an InputError
naming `model` (a 400), and it has no KV cache to show.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.engine.kv_publisher import KVViewUnavailable
from pagedllm.engine.pooling_engine import PoolingEngine, PoolingInput
from pagedllm.engine.protocol import EngineBusyError, EngineClosedError, StatsObserver
from pagedllm.errors import InputError


@dataclass
class _Job:
    task: str  # "embed" or "score"; "call": run `call` alone
    items: list[PoolingInput]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)
    call: Callable[[], Any] | None = None


class AsyncPoolingEngine:
    observer: StatsObserver | None  # set by the server; nothing to tell it (no tokens are generated)

    def __init__(self, engine: PoolingEngine, max_num_waiting: int | None = 256):
        self.engine = engine
        self.observer: StatsObserver | None = None
        self.max_num_waiting = max_num_waiting
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._waiting = 0  # inputs queued or running
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pagedllm-pooling", daemon=True)
        self._thread.start()

    # ---- what the pooling routes call

    @property
    def task(self) -> str:
        return self.engine.task

    @property
    def normalizes(self) -> bool:
        return self.engine.spec.normalize

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        return self.engine.spec.matryoshka_dimensions

    @property
    def hidden_size(self) -> int:
        return self.engine.model_config.hidden_size

    async def tokenize(
        self, texts: list[str | tuple[str, str]], truncate: int | None, param: str
    ) -> list[PoolingInput]:
        """The texts (or pairs) tokenized in a worker thread (the tokenizer releases the GIL)."""
        return await asyncio.to_thread(lambda: [self.engine.tokenize(t, truncate, param) for t in texts])

    def check(self, items: list[PoolingInput], truncate: int | None, param: str) -> list[PoolingInput]:
        return [self.engine.check(item, truncate, param) for item in items]

    async def embed(self, items: list[PoolingInput]) -> torch.Tensor:
        """[N, hidden] float32 pooled vectors, computed on the engine thread with whatever else is queued."""
        return await self._submit("embed", items)

    async def score(self, items: list[PoolingInput]) -> torch.Tensor:
        """[N, num_labels] float32 cross-encoder scores."""
        return await self._submit("score", items)

    async def score_pairs(
        self, pairs: list[tuple[str, str]], truncate: int | None, param: str
    ) -> tuple[torch.Tensor, int]:
        """PoolingEngine.score_pairs on the engine thread: one score per pair, and the tokens read."""
        return await self._submit("call", [], lambda: self.engine.score_pairs(pairs, truncate, param))

    async def _submit(
        self, task: str, items: list[PoolingInput], call: Callable[[], Any] | None = None
    ) -> Any:
        if self._closed or not self._thread.is_alive():
            raise EngineClosedError("the engine is shutting down")
        if (
            self.max_num_waiting is not None
            and self._waiting + len(items) > self.max_num_waiting
            and self._waiting
        ):
            raise EngineBusyError(f"{self._waiting} inputs are waiting; retry later")
        loop = asyncio.get_running_loop()
        job = _Job(task, items, loop, loop.create_future(), call)
        self._waiting += len(items)
        self._jobs.put(job)
        try:
            return await job.future
        finally:
            self._waiting -= len(items)

    def _loop(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            if first.call is not None:
                self._run_call(first)
                continue
            jobs = [first]
            held: list[_Job | None] = []
            while True:  # every request queued meanwhile: one round of forwards for the same task
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                (jobs if job is not None and job.task == first.task else held).append(job)
            for job in held:
                self._jobs.put(job)
            items = [item for job in jobs for item in job.items]
            try:
                out = self.engine.embed(items) if first.task == "embed" else self.engine.score(items)
            except BaseException as e:  # noqa: BLE001 - handed to each waiting request
                for job in jobs:
                    job.loop.call_soon_threadsafe(_fail, job.future, e)
                continue
            start = 0
            for job in jobs:
                part = out[start : start + len(job.items)]
                start += len(job.items)
                job.loop.call_soon_threadsafe(_resolve, job.future, part)

    def _run_call(self, job: _Job) -> None:
        try:
            value = job.call()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            job.loop.call_soon_threadsafe(_fail, job.future, e)
        else:
            job.loop.call_soon_threadsafe(_resolve, job.future, value)

    # ---- EngineClient

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def replica_labels(self) -> list[str] | None:
        return None

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def health(self) -> list[dict[str, Any]] | None:
        return None

    def get_stats(self) -> None:
        return None  # no KV cache, no steps: the engine gauges stay at zero

    def _refuse(self) -> InputError:
        return InputError(
            f"this server's model is a pooling model ({self.task}): use /v1/embeddings"
            + (", /v1/rerank or /score" if self.task == "score" else ""),
            param="model",
        )

    async def validate_structured_outputs(self, params: Any) -> None:
        raise self._refuse()

    async def add_request(self, request_id, prompt, params, arrival_time=None, priority=0, lora_request=None):
        raise self._refuse()

    async def add_lora(self, lora_request: Any) -> int:
        raise InputError("LoRA adapters are for generative models; this server's model pools", param="lora")

    async def remove_lora(self, lora_int_id: int) -> bool:
        return False  # none was ever registered

    async def generate(self, prompt, params, request_id=None) -> AsyncIterator[Any]:
        raise self._refuse()
        yield  # an async generator, as EngineClient.generate is

    def abort(self, request_id: str | list[str]) -> None:
        """Nothing to abort: a pooling request is one forward, over when it is answered."""

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, timeout)

    @property
    def publishes_kv_view(self) -> bool:
        return False

    async def watch_kv(self):
        raise KVViewUnavailable("a pooling model has no KV cache")

    def unwatch_kv(self, sub) -> None:
        pass

    async def kv_block(self, block_id: int) -> dict[str, Any]:
        raise KVViewUnavailable("a pooling model has no KV cache")

    async def hold_steps(self, hold: bool) -> dict[str, Any]:
        raise KVViewUnavailable("a pooling model has no KV cache")


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
