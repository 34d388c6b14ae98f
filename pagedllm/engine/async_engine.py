"""AsyncEngine: serve a thread-unsafe LLMEngine to many asyncio callers.

One background thread owns the engine. It is the only thread that ever touches it: it applies the
queued add/abort commands, calls engine.step() while work exists, and hands each RequestOutput to the
asyncio.Queue of its request through loop.call_soon_threadsafe. The model's forward pass runs in torch,
which releases the GIL, so the event loop stays responsive while a step computes.

    engine = AsyncEngine(LLMEngine(model="default"))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)        # cumulative text so far
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.client_base import EngineClientBase, RequestStream, RequestTiming, id_list
from pagedllm.engine.kv_publisher import KVPublisher, KVSubscription
from pagedllm.engine.protocol import EngineBusyError, EngineClosedError, RequestFailedError, StatsObserver
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams

# The errors and the stream are defined with the interface (engine/protocol.py, engine/client_base.py);
# importing them from here still works.
__all__ = ["AsyncEngine", "EngineBusyError", "EngineClosedError", "RequestFailedError", "RequestStream"]

logger = logging.getLogger(__name__)

# How long the idle loop thread sleeps on the command queue before re-checking its stop flag.
_IDLE_POLL_S = 0.05


@dataclass
class _Stream:
    """Where the outputs of one request go: a queue that belongs to the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine(EngineClientBase):
    """Runs `engine` in a background thread and exposes it to asyncio, as an EngineClient.

    `stats_observer` (optional, e.g. pagedllm.metrics.ServerMetrics) is called on the loop thread with
    `on_output(output, new_tokens, timing, now, replica=None)` for every RequestOutput and
    `on_abort(request_id)`.
    """

    replica_labels: list[str] | None = None  # one engine, no replicas

    def __init__(
        self,
        engine: Any,
        *,
        stats_observer: StatsObserver | None = None,
        start: bool = True,
        max_num_waiting: int | None = None,
    ):
        """max_num_waiting: the most sequences that may wait for a place in the running batch; a request
        that would pass it is refused (EngineBusyError) instead of queueing behind everyone (None: no bound).
        """
        super().__init__(stats_observer)
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._timings: dict[str, RequestTiming] = {}  # loop thread only
        self._stop = threading.Event()
        self._stats = None
        self._stats_failing = False
        self._kv = KVPublisher(engine)  # the /kv page's snapshots; inert until a page subscribes
        self._held = False  # test-only (hold_steps): no step runs while set
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-loop", daemon=True)
        self.error: BaseException | None = None  # set when the loop thread itself died
        if start:
            self.start()

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def health(self) -> list[dict[str, Any]] | None:
        """None: a single engine has no replicas to report; `is_running` is its health."""
        return None

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request; raises what engine.add_request raises (InputError) here, in the caller.
        lora_request: a lora.LoRARequest, the adapter to run it with."""
        self._check_accepting()
        stream = _Stream(loop=asyncio.get_running_loop())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(
            ("add", (request_id, prompt, params, arrival_time, priority, stream, done, lora_request))
        )
        await asyncio.wrap_future(done)
        return RequestStream(self, request_id, stream.queue)

    async def validate_structured_outputs(self, params: Any) -> None:
        """Check a StructuredOutputsParams in a worker thread (InputError when malformed), so that neither
        the event loop nor the engine's step waits for it; the engine later finds it in its cache."""
        manager = getattr(self.engine, "structured_output", None)
        if manager is None:
            raise InputError("this engine has no structured outputs", param="structured_outputs")
        await asyncio.get_running_loop().run_in_executor(None, manager.validate, params)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort from any thread; the loop thread applies it before its next step."""
        self._commands.put(("abort", id_list(request_id)))

    def get_stats(self) -> Any:
        """The engine stats as of the end of the last step (a snapshot the loop thread refreshes)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ the KV cache, for /kv (any thread)

    @property
    def publishes_kv_view(self) -> bool:
        """Whether watch_kv can work: the engine has a KV cache view (a stand-in engine may not)."""
        return self._kv.supported

    async def watch_kv(self) -> KVSubscription:
        """Subscribe to KVCacheView snapshots (engine/kv_publisher.py); unwatch_kv when done. Raises
        KVViewUnavailable when the engine has no view, EngineClosedError when it stopped."""
        sub = KVSubscription(asyncio.get_running_loop())
        await self._call("kv_watch", sub)
        return sub

    def unwatch_kv(self, sub: KVSubscription) -> None:
        """Leave; the last watcher to leave closes the view, and the engine records nothing again."""
        self._commands.put(("kv_unwatch", sub))

    async def kv_block(self, block_id: int) -> dict[str, Any]:
        """One block's state, ref_cnt, hash, holders and token ids (KVCacheView.block_info)."""
        return await self._call("kv_block", block_id)

    async def hold_steps(self, hold: bool) -> dict[str, Any]:
        """Test-only: stop (or resume) stepping between two steps, publish a snapshot of that moment and
        return its seq with the KVCacheManager's own state (KVCacheView.manager_state), so a test can
        compare the page against the engine at one instant. Requests stay where they are while held."""
        return await self._call("kv_hold", hold)

    async def add_lora(self, lora_request: Any) -> int:
        """Register a LoRA adapter on the loop thread (its folder read and checked: InputError if bad)."""
        return await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call("remove_lora", lora_int_id)

    async def _call(self, kind: str, arg: Any) -> Any:
        """Run a command on the loop thread and await its result."""
        if not self.is_running:
            raise EngineClosedError("the engine loop is not running")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((kind, (arg, done)))
        return await asyncio.wrap_future(done)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` s, abort the rest, stop."""
        await self._drain(timeout)
        if self._streams and self.is_running:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._commands.put(("abort_all", done))
            try:
                await asyncio.wait_for(asyncio.wrap_future(done), timeout=max(1.0, timeout))
            except asyncio.TimeoutError:
                logger.warning("engine loop did not abort in-flight requests in time")
        self._stop.set()
        self._commands.put(("wake", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, max(1.0, timeout))
        if not self._thread.is_alive():  # else the engine is still in use: leave its workers running
            self.engine.shutdown()  # tensor-parallel worker processes

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        self._refresh_stats()
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests() and not self._held
                self._apply_commands(block=not busy)
                if self.engine.has_unfinished_requests() and not self._held:
                    self._step()
                if self._kv.active:
                    self._kv.tick()
        except BaseException as e:  # a bug in this loop itself: fail everyone rather than hang them
            logger.exception("engine loop died")
            self.error = e
            self._fail_all(EngineClosedError(f"engine loop died: {e!r}"))
        finally:
            self._kv.close_all()
            self._reject_pending()

    def _apply_commands(self, block: bool) -> None:
        """Apply all queued commands; when idle, wait a little for the first one."""
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            request_id, prompt, params, arrival_time, priority, stream, done, lora_request = arg
            try:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in flight")
                self._check_queue(params)
                lora = {"lora_request": lora_request} if lora_request is not None else {}
                self.engine.add_request(
                    request_id, prompt, params, arrival_time=arrival_time, priority=priority, **lora
                )
            except Exception as e:  # InputError and friends go back to the caller of add_request
                done.set_exception(e)
                return
            self._streams[request_id] = stream
            self._timings[request_id] = RequestTiming(arrival=time.monotonic())
            done.set_result(None)
            self._refresh_stats()
        elif kind == "abort":
            self._abort(arg, RequestFailedError("the request was aborted"))
        elif kind == "abort_all":
            self._abort(list(self._streams), RequestFailedError("aborted: the server is shutting down"))
            arg.set_result(None)
        elif kind in ("add_lora", "remove_lora"):  # LoRA adapters (the server's runtime updating)
            payload, done = arg
            try:
                done.set_result(getattr(self.engine, kind)(payload))
            except Exception as e:  # InputError naming a bad folder goes back to the caller
                done.set_exception(e)
        elif kind == "kv_unwatch":
            self._kv.remove(arg)
        elif kind.startswith("kv_"):
            self._apply_kv(kind, *arg)
        # "wake" only interrupts the idle wait
        if self._kv.active:
            self._kv.touch()

    def _apply_kv(self, kind: str, arg: Any, done: concurrent.futures.Future[Any]) -> None:
        """The /kv commands, answered through `done` (an error goes back to the caller)."""
        try:
            if kind == "kv_watch":
                self._kv.add(arg)
                result = None
            elif kind == "kv_block":
                result = self._kv.view().block_info(arg)
            else:  # kv_hold
                self._held = bool(arg)
                seq = self._kv.publish() if self._kv.active else None
                result = {"seq": seq, "manager": self._kv.view().manager_state()}
        except Exception as e:
            done.set_exception(e)
            return
        finally:
            self._kv.release_if_unwatched()  # a view opened only for this call
        done.set_result(result)

    def _check_queue(self, params: SamplingParams) -> None:
        # Here on the loop thread the engine's count is exact: it includes the requests added since the
        # last step (a burst of them all arrives between two steps).
        limit = self.max_num_waiting
        if limit is None:
            return
        waiting = self.engine.get_stats().num_waiting
        if waiting + params.n > limit:
            raise EngineBusyError(
                f"the server is at capacity ({waiting} sequences waiting, --max-num-waiting {limit}); "
                "retry shortly"
            )

    def _abort(self, ids: list[str], error: BaseException) -> None:
        """Abort in the engine (freeing blocks) and end each stream with `error`, so that a consumer
        still waiting (not the one that asked for the abort) is not left hanging."""
        ids = [i for i in ids if i in self._streams]
        if not ids:
            return
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("abort_request(%s) failed", ids)
        for request_id in ids:
            self._deliver(self._streams.pop(request_id), error)
            timing = self._timings.pop(request_id, None)
            if self.observer is not None and timing is not None:
                self.observer.on_abort(request_id)
        self._refresh_stats()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # We cannot tell which request broke the step, so every in-flight request gets the error
            # and is aborted; the loop itself keeps serving new requests.
            logger.exception("engine.step() failed; aborting %d in-flight requests", len(self._streams))
            self._abort(list(self._streams), RequestFailedError(f"engine step failed: {e!r}"))
            return
        now = time.monotonic()
        for output in outputs:
            self._observe(output, now)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._streams[output.request_id]
            self._deliver(stream, output)
        self._refresh_stats()

    def _observe(self, output: Any, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        self._account(timing, output, now)
        if output.finished:
            del self._timings[output.request_id]

    def _deliver(self, stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._deliver(stream, error)

    def _reject_pending(self) -> None:
        """Answer commands that raced with shutdown so that no caller awaits forever."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" or (kind.startswith("kv_") and kind != "kv_unwatch"):
                arg[-1].set_exception(EngineClosedError("the engine is shutting down"))
            elif kind == "abort_all":
                arg.set_result(None)

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.get_stats()
            self._stats_failing = False
        except Exception:
            if not self._stats_failing:  # once per failure streak: this runs after every step
                logger.exception("engine.get_stats() failed; /metrics keeps the last snapshot")
            self._stats_failing = True
