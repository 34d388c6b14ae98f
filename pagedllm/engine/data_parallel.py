"""Data parallelism: N engine replicas, each a Ray actor in its own process, behind one front end.

    engine = DataParallelEngine(engine_kwargs, num_replicas=2)          # a local Ray (ray.init)
    engine = DataParallelEngine(engine_kwargs, 2, ray_address="HOST:PORT")   # join a running cluster
    async for out in engine.generate(token_ids, SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)        # cumulative, as from AsyncEngine
    await engine.shutdown()

`pagedllm serve --data-parallel-size N` serves one of these in place of an AsyncEngine: the OpenAI front end
(tokenizer, chat template, validation, SSE) stays in the server's process and sees the same EngineClient
(engine/protocol.py).

How it works
- Each replica (`ReplicaWorker`, made a Ray actor by `ray.remote`) builds its own LLMEngine from the same
  keywords (all of them, `tensor_parallel_size` included), warms it up and runs it in an AsyncEngine.
- The front end keeps one long poll in flight per replica (`ReplicaWorker.poll`): it returns every request's
  latest cumulative RequestOutput since the previous poll (at most one per request: the outputs are
  cumulative, so the ones in between carry nothing new), the failures, and the replica's EngineStats. So
  the cost is one RPC per replica per engine step, whatever the number of requests in flight.
- `PrefixRouter` picks the replica: the one it last sent the longest prefix of this prompt to (block
  hashes chained exactly as the prefix cache chains them, `core.block_pool.hash_block_tokens`, in an LRU
  map hash -> replica), unless that prefix is under half of the prompt or that replica is already
  `max_imbalance` requests busier than the least loaded one; otherwise the least loaded live replica.
- A replica whose process dies (an RPC to it raises RayActorError) is marked dead and never chosen again;
  the others keep serving. Its in-flight requests that have not yet delivered any output are retried once
  on another live replica (nothing was streamed, so the client cannot tell); the ones that have streamed
  something end with RequestFailedError (a 500, or an in-band error on a stream), as does a retried request
  whose second replica dies too.
- A replica that refuses a request because its queue is full (EngineBusyError) passes it to the next
  least loaded one; only when every replica refuses does the caller get EngineBusyError (503).

`ray` is imported only when a DataParallelEngine is built, never by importing this module.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.client_base import EngineClientBase, RequestStream, RequestTiming, id_list
from pagedllm.engine.kv_publisher import KVSubscription, KVViewUnavailable
from pagedllm.engine.prefix_router import PrefixRouter
from pagedllm.engine.protocol import EngineBusyError, EngineClosedError, RequestFailedError
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig
    from pagedllm.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A replica's poll returns after this long even when nothing happened, so that its stats stay fresh.
POLL_TIMEOUT_S = 1.0
# How long start-up waits for every replica to be placed, load its model and warm up.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
_NO_KV_VIEW = "data-parallel replicas each have their own KV pool: there is no one view to show"


# ---------------------------------------------------------------------------------------------- replica


# LoRA adapters (pagedllm/lora) live in one engine; replicas would each need them registered alike
_NO_LORA = "LoRA adapters are not supported with --data-parallel-size / --ray-address yet"

class ReplicaWorker:
    """One replica: an LLMEngine in an AsyncEngine, inside a Ray actor (`ray.remote(ReplicaWorker)`).

    Its methods are async: Ray runs them on the actor's event loop, which is also the loop the AsyncEngine
    hands outputs to. Errors a caller should see (InputError, EngineBusyError) are returned as
    (class name, message, param) rather than raised, so that they arrive without Ray's traceback wrapper.
    """

    def __init__(self, engine_kwargs: dict[str, Any], threads: int | None, max_num_waiting: int | None):
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
            try:
                torch.set_num_interop_threads(threads)
            except RuntimeError:
                pass
        from pagedllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(**engine_kwargs)
        engine.warm_up()
        self.engine = AsyncEngine(engine, max_num_waiting=max_num_waiting)
        self._tasks: dict[str, asyncio.Task] = {}
        self._outputs: dict[str, Any] = {}  # request id -> latest cumulative output not yet polled
        self._errors: dict[str, str] = {}  # request id -> why it failed, not yet polled
        self._event: asyncio.Event | None = None

    def _wake(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    async def describe(self) -> dict[str, Any]:
        import ray

        inner = self.engine.engine
        cache = getattr(inner, "cache_config", None)
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "max_model_len": inner.max_model_len,
            "model_config": inner.model_config,
            "block_size": getattr(cache, "block_size", 16),
            "enable_prefix_caching": getattr(cache, "enable_prefix_caching", True),
        }

    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None, priority: int
    ) -> tuple[str, str, str | None] | None:
        try:
            stream = await self.engine.add_request(request_id, prompt, params, arrival_time, priority)
        except InputError as e:
            return ("InputError", str(e), e.param)
        except (EngineBusyError, EngineClosedError, ValueError) as e:
            return (type(e).__name__, str(e), None)
        self._tasks[request_id] = asyncio.get_running_loop().create_task(self._pump(request_id, stream))
        return None

    async def _pump(self, request_id: str, stream: Any) -> None:
        try:
            async for output in stream:
                self._outputs[request_id] = output
                self._wake().set()
        except asyncio.CancelledError:
            stream.close()
            raise
        except Exception as e:
            self._errors[request_id] = str(e)
            self._wake().set()
        finally:
            self._tasks.pop(request_id, None)

    async def poll(self, timeout: float) -> tuple[list[Any], dict[str, str], Any]:
        """Wait up to `timeout` s for news; then (outputs, errors by request id, EngineStats)."""
        event = self._wake()
        if not self._outputs and not self._errors:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        event.clear()
        outputs, self._outputs = list(self._outputs.values()), {}
        errors, self._errors = self._errors, {}
        if not self.engine.is_running and self.engine.error is not None:
            raise RuntimeError(f"the replica's engine loop died: {self.engine.error!r}")
        return outputs, errors, self.engine.get_stats()

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            task = self._tasks.pop(request_id, None)
            if task is not None:
                task.cancel()  # closes the stream: the engine aborts the request and frees its blocks
            self._outputs.pop(request_id, None)
            self._errors.pop(request_id, None)
        self.engine.abort(request_ids)

    async def shutdown(self, timeout: float) -> None:
        await self.engine.shutdown(timeout=timeout)


# ---------------------------------------------------------------------------------------------- front end


@dataclass
class _Request:
    """The front end's view of one request in flight."""

    request_id: str
    prompt: Any
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    queue: asyncio.Queue
    timing: RequestTiming
    replica: int = -1
    label: str | None = None  # of the replica it was last sent to (for metrics)
    delivered: bool = False  # an output reached the consumer: no retry on another replica
    retried: bool = False
    submitting: bool = False  # add_request to a replica is in flight (the submitter handles its death)
    done: bool = False
    tried: set[int] = field(default_factory=set)


class _RayOwner:
    """ray.init() in a thread that lives until stop(), which calls ray.shutdown() there.

    Ray starts a local cluster's processes (gcs_server, raylet) with PR_SET_PDEATHSIG, which fires when the
    *thread* that started them ends: had the server's short-lived loading thread called ray.init(), the
    cluster would die with it, right after start-up."""

    def __init__(self, ray: Any, init_kwargs: dict[str, Any]):
        self._ray = ray
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(init_kwargs,), name="pagedllm-ray", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self, init_kwargs: dict[str, Any]) -> None:
        try:
            self._ray.init(**init_kwargs)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._stop.wait()
        self._ray.shutdown()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class DataParallelEngine(EngineClientBase):
    """`num_replicas` LLMEngines as Ray actors, behind one EngineClient (engine/protocol.py).

    See the module docstring for routing, streaming and what happens when a replica dies.
    `observer` (e.g. pagedllm.metrics.ServerMetrics) gets `on_output(..., replica=LABEL)` and `on_abort`
    on the front end's event loop as outputs arrive.
    """

    tokenizer: Tokenizer
    max_model_len: int  # the least of the replicas'
    model_config: ModelConfig
    replica_labels: list[str]
    # Each replica has its own KV pool: there is no one view for /kv to show.
    publishes_kv_view = False

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        num_replicas: int,
        *,
        ray_address: str | None = None,
        max_num_waiting: int | None = None,
        num_cpus_per_replica: float = 1.0,
        threads: int | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
        router_kwargs: dict[str, Any] | None = None,
    ):
        if num_replicas < 1:
            raise InputError(
                f"--data-parallel-size must be at least 1, got {num_replicas}", param="--data-parallel-size"
            )
        super().__init__()
        from pagedllm.model.loader import resolve_model_path
        from pagedllm.model.tokenizer import Tokenizer

        # The front end tokenizes and renders chat templates itself (and a missing model fails here, early).
        self.tokenizer = Tokenizer.from_checkpoint(
            resolve_model_path(str(engine_kwargs.get("model", "default")))
        )
        if ray_address is None:
            # Before ray is imported (it reads this once): a local Ray listens on loopback only. It is a
            # single-node Ray for this server, so nothing needs to reach it from another machine.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        from ray.exceptions import GetTimeoutError

        self._ray = ray
        self.num_replicas = num_replicas
        self._ray_owner: _RayOwner | None = None
        if not ray.is_initialized():
            if ray_address is None:
                # "local": a fresh Ray for this server, never some cluster found running on the machine; with
                # a CPU for every replica even on a small machine.
                cpus = max(os.cpu_count() or 1, math.ceil(num_replicas * num_cpus_per_replica))
                init = dict(address="local", num_cpus=cpus, include_dashboard=False)
            else:
                init = dict(address=ray_address)
            self._ray_owner = _RayOwner(ray, dict(init, log_to_driver=True))
        if threads is None:
            threads = max(1, int(num_cpus_per_replica))
        actor_cls = ray.remote(ReplicaWorker)
        self._actors = [
            actor_cls.options(
                name=None,
                num_cpus=num_cpus_per_replica,
                max_restarts=0,
                max_concurrency=10_000,
                scheduling_strategy="SPREAD",  # one replica a node while nodes last
            ).remote(dict(engine_kwargs), threads, max_num_waiting)
            for _ in range(num_replicas)
        ]
        refs = [a.describe.remote() for a in self._actors]
        try:
            infos = ray.get(refs, timeout=startup_timeout)
        except GetTimeoutError:
            self._abandon()
            raise RuntimeError(
                f"the {num_replicas} replicas did not all start within {startup_timeout:.0f} s: does the Ray "
                f"cluster have {num_cpus_per_replica:g} CPU free for each?"
            ) from None
        except BaseException as e:
            self._abandon()
            # A replica's InputError (a bad option) as the CLI reports it: one line, exit 2. Ray hands it
            # over as ActorDiedError, with the replica's traceback in its text.
            found = re.findall(r"pagedllm\.errors\.InputError: (.+)", str(e))
            if found:
                raise InputError(found[-1].strip()) from None
            raise
        self.replicas: list[dict[str, Any]] = infos
        self.replica_labels = [str(i) for i in range(num_replicas)]
        first = infos[0]
        self.max_model_len = min(int(i["max_model_len"]) for i in infos)
        self.model_config = first["model_config"]
        self.block_size = int(first["block_size"])
        self.router = PrefixRouter(
            num_replicas,
            self.block_size,
            enable_prefix_affinity=bool(first["enable_prefix_caching"]),
            **(router_kwargs or {}),
        )
        for i, info in enumerate(infos):
            logger.info("replica %d: pid %d on node %s", i, info["pid"], info["node_id"])
        self._requests: dict[str, _Request] = {}
        self._stats: list[Any] = [None] * num_replicas
        self._pollers: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------ EngineClient

    @property
    def is_running(self) -> bool:
        return not self._closed and any(self.router.alive)

    def get_stats(self) -> dict[str, Any]:
        """The latest EngineStats of each replica by its label; None for a replica that died."""
        return {
            label: (self._stats[i] if self.router.alive[i] else None)
            for i, label in enumerate(self.replica_labels)
        }

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def health(self) -> list[dict[str, Any]]:
        """Per replica: its label, whether it is alive, its process id and Ray node, its requests in flight."""
        return [
            {
                "replica": label,
                "alive": self.router.alive[i],
                "pid": self.replicas[i]["pid"],
                "node_id": self.replicas[i]["node_id"],
                "in_flight": self.router.in_flight[i],
            }
            for i, label in enumerate(self.replica_labels)
        ]

    async def validate_structured_outputs(self, params: Any) -> None:
        """InputError when the constraint is malformed; checked here (a pure function of the constraint),
        compiled later by the replica that runs the request."""
        from pagedllm.structured_output.grammar import grammar_text

        await asyncio.get_running_loop().run_in_executor(None, grammar_text, params)

    async def add_lora(self, lora_request: Any) -> int:
        raise InputError(_NO_LORA, param="lora_name")

    async def remove_lora(self, lora_int_id: int) -> bool:
        raise InputError(_NO_LORA, param="lora_name")

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> RequestStream:
        """Route and queue a request; raises InputError / EngineBusyError / EngineClosedError here."""
        if lora_request is not None:
            raise InputError(_NO_LORA, param="model")
        self._check_accepting()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._ensure_pollers()
        token_ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)
        request = _Request(
            request_id=request_id,
            prompt=prompt,
            token_ids=token_ids,
            params=params,
            arrival_time=arrival_time,
            priority=priority,
            queue=asyncio.Queue(),
            timing=RequestTiming(arrival=time.monotonic()),
        )
        self._requests[request_id] = request
        try:
            await self._submit(request)
        except BaseException:
            self._drop(request)
            raise
        return RequestStream(self, request.request_id, request.queue)

    def abort(self, request_id: str | list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in id_list(request_id):
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.replica >= 0:
                by_replica.setdefault(request.replica, []).append(rid)
            self._finish(request, RequestFailedError("the request was aborted"))
            if self.observer is not None:
                self.observer.on_abort(rid, replica=request.label)
        for replica, rids in by_replica.items():
            if self.router.alive[replica]:
                self._actors[replica].abort.remote(rids)  # fire and forget

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` s, abort the rest, then stop
        every replica (and the local Ray this engine started)."""
        if self._closed:
            return
        await self._drain(timeout)
        if self._requests:
            self.abort(list(self._requests))
        self._closed = True
        live = [a for i, a in enumerate(self._actors) if self.router.alive[i]]
        if live:
            done, _ = await asyncio.wait(
                [asyncio.ensure_future(self._await_ref(a.shutdown.remote(1.0))) for a in live],
                timeout=max(2.0, timeout),
            )
        for task in self._pollers:
            task.cancel()
        self._kill_all()
        if self._ray_owner is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._ray_owner.stop)

    # ------------------------------------------------------------------ no KV view (each replica has its pool)

    async def watch_kv(self) -> KVSubscription:
        raise KVViewUnavailable(_NO_KV_VIEW)

    def unwatch_kv(self, sub: KVSubscription) -> None:
        """Nothing to leave: watch_kv never subscribes."""

    async def kv_block(self, block_id: int) -> dict[str, Any]:
        raise KVViewUnavailable(_NO_KV_VIEW)

    async def hold_steps(self, hold: bool) -> dict[str, Any]:
        raise KVViewUnavailable(_NO_KV_VIEW)

    # ------------------------------------------------------------------ internals

    @staticmethod
    async def _await_ref(ref: Any) -> Any:
        return await ref

    def _kill_all(self) -> None:
        for actor in getattr(self, "_actors", []):
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass

    def _abandon(self) -> None:
        """Start-up failed: stop the replicas and the local Ray."""
        self._kill_all()
        if self._ray_owner is not None:
            self._ray_owner.stop()

    def _ensure_pollers(self) -> None:
        if not self._pollers:
            loop = asyncio.get_running_loop()
            self._pollers = [loop.create_task(self._poll_loop(i)) for i in range(self.num_replicas)]

    async def _submit(self, request: _Request) -> None:
        """Send the request to the router's choice; a dead replica or a full queue passes it to the next.

        request.tried holds the replicas already tried, so a retry never returns to one of them."""
        busy: BaseException | None = None
        request.submitting = True
        try:
            while True:
                try:
                    replica = self.router.choose(request.token_ids, exclude=request.tried)
                except EngineClosedError:
                    if busy is not None:
                        raise busy from None
                    raise
                request.tried.add(replica)
                request.replica = replica
                request.label = self.replica_labels[replica]
                self.router.assign(request.token_ids, replica)
                actor = self._actors[replica]
                try:
                    error = await actor.add_request.remote(
                        request.request_id,
                        request.prompt,
                        request.params,
                        request.arrival_time,
                        request.priority,
                    )
                except asyncio.CancelledError:
                    self._unassign(request)
                    actor.abort.remote([request.request_id])
                    raise
                except self._ray.exceptions.RayError as e:
                    self._unassign(request)
                    self._replica_died(replica, e)
                    continue
                if error is None:
                    if request.done:  # aborted while this retry was on its way: undo it there
                        actor.abort.remote([request.request_id])
                        self._unassign(request)  # unless abort() already did
                    return
                self._unassign(request)
                kind, message, param = error
                if kind == "EngineBusyError":
                    busy = EngineBusyError(message)
                    continue
                if kind == "EngineClosedError":
                    continue
                if kind == "InputError":
                    raise InputError(message, param=param)
                raise ValueError(message)
        finally:
            request.submitting = False

    async def _retry(self, request: _Request) -> None:
        try:
            await self._submit(request)
        except Exception as e:
            self._finish(request, RequestFailedError(f"the request's replica died and the retry failed: {e}"))

    async def _poll_loop(self, replica: int) -> None:
        actor = self._actors[replica]
        while not self._closed and self.router.alive[replica]:
            try:
                outputs, errors, stats = await actor.poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # RayActorError when the process died; anything else is as fatal
                if not self._closed:
                    self._replica_died(replica, e)
                return
            self._stats[replica] = stats
            now = time.monotonic()
            for output in outputs:
                request = self._requests.get(output.request_id)
                if request is None or request.replica != replica:
                    continue  # aborted meanwhile, or already moved elsewhere
                self._account(request.timing, output, now, replica=self.replica_labels[replica])
                request.delivered = True
                if output.finished:
                    self._finish(request, output)
                else:
                    request.queue.put_nowait(output)
            for request_id, message in errors.items():
                request = self._requests.get(request_id)
                if request is not None and request.replica == replica:
                    self._finish(request, RequestFailedError(message))

    def _replica_died(self, replica: int, error: BaseException) -> None:
        """Stop routing to it; retry its requests that streamed nothing (once), fail the others."""
        if self.router.alive[replica]:
            logger.error(
                "replica %d (pid %d) died: %s; %d replicas left",
                replica,
                self.replicas[replica]["pid"],
                str(error).splitlines()[0] if str(error) else type(error).__name__,
                sum(self.router.alive) - 1,
            )
        self.router.mark_dead(replica)
        for request in list(self._requests.values()):
            if request.replica != replica or request.submitting or request.done:
                continue
            request.replica = -1
            if not request.delivered and not request.retried and self.router.live_replicas(request.tried):
                request.retried = True
                asyncio.get_running_loop().create_task(self._retry(request))
            else:
                self._finish(request, RequestFailedError(f"engine replica {replica} died during the request"))

    def _finish(self, request: _Request, item: Any) -> None:
        """Last item of a request's stream (its finished output or an error); it leaves the books."""
        if request.done:
            return
        request.queue.put_nowait(item)
        self._drop(request)

    def _drop(self, request: _Request) -> None:
        request.done = True
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        self._unassign(request)

    def _unassign(self, request: _Request) -> None:
        if request.replica >= 0:
            self.router.release(request.replica)
            request.replica = -1
