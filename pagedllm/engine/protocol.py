"""EngineClient: the one interface the OpenAI server has to an engine (vLLM's vllm/engine/protocol.py).

Two engines implement it: AsyncEngine (one LLMEngine on a background thread) and DataParallelEngine
(LLMEngine replicas on Ray). The server types its engine as EngineClient and reads every member plainly,
so each one is a real member of both engines, with a single engine's answer where replicas make no sense
(`replica_labels` and `health()` are None, `publishes_kv_view` is what its pool offers). The errors a
caller must handle live here too, since they are part of the contract, not of one engine.

tests/test_engine_client.py checks that both engines (and the test fakes) define every member.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig
    from pagedllm.engine.client_base import RequestStream, RequestTiming
    from pagedllm.engine.kv_publisher import KVSubscription
    from pagedllm.engine.llm_engine import EngineStats
    from pagedllm.model.tokenizer import Tokenizer
    from pagedllm.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or its loop thread died): no new requests are taken."""


class EngineBusyError(RuntimeError):
    """The waiting queue is full (max_num_waiting): the server answers 503 with Retry-After."""


class RequestFailedError(RuntimeError):
    """The request ended unfinished: engine.step() raised, it was aborted, or the engine shut down."""


class StatsObserver(Protocol):
    """What an engine tells as outputs arrive (pagedllm.metrics.ServerMetrics); `replica` is the label of
    the replica that produced it, None for a single engine."""

    def on_output(
        self, output: Any, new_tokens: int, timing: RequestTiming, now: float, replica: str | None = None
    ) -> None:
        """One RequestOutput; `timing` is the request's as it was *before* this output."""

    def on_abort(self, request_id: str, replica: str | None = None) -> None:
        """A request was aborted before it finished."""


@runtime_checkable
class EngineClient(Protocol):
    """Everything the server uses of an engine. Members not marked otherwise may be called from any
    coroutine on the server's event loop."""

    observer: StatsObserver | None
    """Set by the server after construction; told of every output and abort."""

    @property
    def tokenizer(self) -> Tokenizer:
        """Encodes prompts and renders chat templates in the server's process."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus completion any request may have (the least of all replicas)."""
        ...

    @property
    def model_config(self) -> ModelConfig:
        """The model's shape; the server reads `vocab_size` to refuse out-of-vocabulary token ids."""
        ...

    @property
    def replica_labels(self) -> list[str] | None:
        """One label per data-parallel replica (metrics carry it); None for a single engine."""
        ...

    @property
    def is_running(self) -> bool:
        """False once the engine has stopped or died (or every replica has): /health answers 503."""
        ...

    def health(self) -> list[dict[str, Any]] | None:
        """Per replica: label, alive, pid, node, requests in flight (/health's `replicas`). None for a
        single engine, whose health is `is_running`."""
        ...

    def get_stats(self) -> EngineStats | Mapping[str, EngineStats | None] | None:
        """The latest EngineStats (None before the first); with replicas, one per label (None: dead)."""
        ...

    async def validate_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Raise InputError when the constraint is malformed, without blocking the event loop."""
        ...

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request and return its stream; priority: lower first under --scheduling-policy priority
        (fcfs refuses anything but 0); lora_request: a lora.LoRARequest, the adapter to run it with. Raises
        InputError, EngineBusyError, EngineClosedError, or ValueError for an id already in flight, here in
        the caller."""
        ...

    async def add_lora(self, lora_request: Any) -> int:
        """Register a LoRA adapter (--enable-lora): its folder read and checked, InputError naming what is
        wrong; returns its lora_int_id."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it); False if it was not registered."""
        ...

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs of one request; closing the iterator early aborts it."""
        ...

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); safe from any thread."""
        ...

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` s, abort the rest, stop."""
        ...

    # ---- the KV cache, for the /kv page (kv_routes.py)

    @property
    def publishes_kv_view(self) -> bool:
        """Whether the KV members below work; when False they raise KVViewUnavailable."""
        ...

    async def watch_kv(self) -> KVSubscription:
        """Subscribe to KVCacheView snapshots; pair with unwatch_kv."""
        ...

    def unwatch_kv(self, sub: KVSubscription) -> None:
        """End a subscription from watch_kv."""
        ...

    async def kv_block(self, block_id: int) -> dict[str, Any]:
        """One block's state, ref_cnt, hash, holders and token ids."""
        ...

    async def hold_steps(self, hold: bool) -> dict[str, Any]:
        """Test-only (--kv-debug-routes): stop or resume stepping, with the KV manager's own state."""
        ...
