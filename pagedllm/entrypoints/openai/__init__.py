"""OpenAI-compatible HTTP server (like vLLM's entrypoints/openai, much smaller).

    protocol.py             request/response bodies (pydantic)
    serving_completion.py   POST /v1/completions
    serving_chat.py         POST /v1/chat/completions
    errors.py               OpenAI-shaped error bodies and the exception handlers
    server.py               the FastAPI app, the other routes, and `run_server(args)`
    cli_args.py             the server's options (shared with `pagedllm serve`) and `make_engine(args)`

This module holds `OpenAIServing`, what both serving classes share: the model-name check, prompt length
and max_tokens checks, logprob decoding, and merging the output streams of several engine requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedllm.engine.client_base import RequestStream
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: Sequence[str]):
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.loras: Any = None  # lora_serving.LoRAModels when the server serves adapters (--enable-lora)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def check_model(self, model: str | None) -> None:
        if (
            model is not None
            and model not in self.served_model_names
            and not (self.loras and model in self.loras)
        ):
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model")

    def check_fields(self, request: Any) -> None:
        """A field pagedllm does not implement is a 400 naming it; fields no API knows get one log line."""
        request.check_refused()
        unknown = request.unknown_fields()
        if unknown:
            logger.info("ignoring unknown request fields: %s", ", ".join(unknown))

    async def validate_constraint(
        self, constraint: StructuredOutputsParams | None, field: str | None
    ) -> None:
        """A malformed schema, regex or grammar is a 400 naming the field the client sent it in."""
        if constraint is None:
            return
        try:
            await self.engine.validate_structured_outputs(constraint)
        except InputError as e:
            message = str(e)
            if field and field != "structured_outputs":
                message = message.replace(f"structured_outputs.{constraint.kind}", field, 1)
            raise InputError(message, param=field) from None

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Out-of-vocabulary ids would crash the embedding lookup inside a batched step: reject them here."""
        vocab_size = self.engine.model_config.vocab_size
        for t in token_ids:
            if t < 0 or t >= vocab_size:
                raise InputError(f"token id {t} is outside the vocabulary (size {vocab_size})", param=param)

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> int:
        """max_tokens, defaulting to what the context leaves; a prompt that can never fit is a 400."""
        if num_prompt_tokens == 0:
            raise InputError(f"{prompt_param} must not be empty", param=prompt_param)
        if num_prompt_tokens >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens (and at least one must be generated).",
                param=prompt_param,
            )
        return self.max_model_len - num_prompt_tokens if max_tokens is None else max_tokens

    def check_context(self, num_prompt_tokens: int, params: SamplingParams, max_tokens_param: str) -> None:
        # Runs after SamplingParams validated max_tokens >= 1, so this message is about the sum only.
        total = num_prompt_tokens + (params.max_tokens or 0)
        if total > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({num_prompt_tokens} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or the completion.",
                param=max_tokens_param,
            )

    @staticmethod
    def prompt_logprobs_field(final: Any, asked: int | None) -> list[dict[str, Any] | None] | None:
        """vLLM's choices[].prompt_logprobs: per prompt position None (the first) or {token id: {logprob,
        rank, decoded_token}}; only when the request's prompt_logprobs field asked for them."""
        if asked is None or final.prompt_logprobs is None:
            return None

        def entry(lp: Any) -> dict[str, Any]:
            return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}

        return [
            None if d is None else {str(t): entry(lp) for t, lp in d.items()} for d in final.prompt_logprobs
        ]

    def decode_token(self, token_id: int, logprob: Any = None) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def add_requests(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int | None = None,
        model: str | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt; if one is refused, the ones already added are aborted. model: the
        request's model field, which may name a LoRA adapter."""
        lora = self.loras.resolve(model) if self.loras else None
        extra = {"lora_request": lora} if lora is not None else {}
        streams: list[RequestStream] = []
        try:
            for i, token_ids in enumerate(prompts):
                rid = f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(rid, token_ids, params, priority=priority or 0, **extra)
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several requests' outputs as they come, as (stream index, RequestOutput)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def last_outputs(streams: list[RequestStream]) -> list[Any]:
    """The final (finished) RequestOutput of each stream."""

    async def last(stream: RequestStream) -> Any:
        output = None
        async for output in stream:  # noqa: B007 - we want the last one
            pass
        return output

    return list(await asyncio.gather(*(last(s) for s in streams)))
