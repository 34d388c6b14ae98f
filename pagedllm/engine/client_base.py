"""What AsyncEngine and DataParallelEngine share as EngineClients: the request stream a caller reads, the
per-request timing behind the latency metrics, and EngineClientBase (ids, generate, the closed check, the
drain before shutdown, the timing bookkeeping). Each engine keeps only how it runs requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.protocol import EngineClient, EngineClosedError, StatsObserver
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def id_list(request_id: str | list[str]) -> list[str]:
    """abort's argument (one id or several) as a list."""
    return [request_id] if isinstance(request_id, str) else list(request_id)


class RequestStream:
    """Async iterator over the cumulative RequestOutputs of one request, ending after the finished one.

    The engine puts each output (or an exception, which ends the stream) on `queue`. Closing the stream
    (or leaving `async with`) before the end aborts the request, which frees its KV blocks.
    """

    def __init__(self, engine: EngineClient, request_id: str, queue: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already dropped (and aborted) this request
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished. Sync so it is safe inside `finally` on cancel."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RequestTiming:
    """Per-request bookkeeping for latency metrics, kept by whoever delivers the request's outputs."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0  # generated so far, summed over the choices
    num_outputs: int = 0  # RequestOutputs seen so far


class EngineClientBase(ABC):
    """The parts of EngineClient (engine/protocol.py) written once. A subclass provides `is_running`,
    `num_in_flight`, `add_request` and `abort`; generate and shutdown's drain are built on them."""

    observer: StatsObserver | None

    def __init__(self, observer: StatsObserver | None = None):
        self.observer = observer
        self._accepting = True
        self._ids = itertools.count()

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Requests added and not yet finished, failed or aborted."""

    @abstractmethod
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestStream: ...

    @abstractmethod
    def abort(self, request_id: str | list[str]) -> None: ...

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[Any]:
        """Yield cumulative RequestOutputs; cancelling or closing the consumer aborts the request."""
        request_id = request_id or self.new_request_id()
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _check_accepting(self) -> None:
        if not self._accepting or not self.is_running:
            raise EngineClosedError("the engine is shutting down and takes no new requests")

    async def _drain(self, timeout: float) -> None:
        """Stop taking requests and wait up to `timeout` s for the ones in flight to finish."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.num_in_flight and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _account(self, timing: RequestTiming, output: Any, now: float, replica: str | None = None) -> None:
        """Tell the observer about `output` (with the timing as it was before it), then advance `timing`."""
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new_tokens = num_tokens - timing.num_tokens
        if self.observer is not None:
            try:
                self.observer.on_output(output, new_tokens, timing, now, replica=replica)
            except Exception:
                logger.exception("metrics observer failed")
        if new_tokens > 0:
            if timing.first_token is None:
                timing.first_token = now
            timing.last_token = now
            timing.num_tokens = num_tokens
        timing.num_outputs += 1
