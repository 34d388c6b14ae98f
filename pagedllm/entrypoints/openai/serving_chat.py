"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.async_engine import EngineClosedError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai import OpenAIServing, last_outputs
from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
    UsageInfo,
    dump_sse,
    random_id,
)
from pagedllm.errors import InputError

ROLE = "assistant"


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


class OpenAIServingChat(OpenAIServing):
    def render_messages(
        self, messages: list[ChatMessageParam], add_generation_prompt: bool = True
    ) -> list[int]:
        """Chat template -> text -> token ids (the template already has the special tokens it wants)."""
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # templates raise on roles/orders they do not support
            raise InputError(f"cannot apply the chat template: {e}", param="messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise InputError("top_logprobs requires logprobs to be true", param="top_logprobs")
        token_ids = self.render_messages(request.messages, request.add_generation_prompt)

        max_tokens_param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.resolve_max_tokens(len(token_ids), requested, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = request.make_sampling_params(max_tokens, logprobs)
        except InputError as e:  # say the field the client sent, not the SamplingParams name
            e.param = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}.get(e.param or "", e.param)
            raise
        self.check_context(len(token_ids), params, max_tokens_param)

        request_id = random_id("chatcmpl")
        (stream,) = await self.add_requests(request_id, [token_ids], params)
        if request.stream:
            return self._stream(request, request_id, len(token_ids), stream)
        try:
            (final,) = await last_outputs([stream])
        finally:
            stream.close()
        return self._response(request, request_id, final)

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Any]], num_top: int
    ) -> ChatCompletionLogProbs:
        content = []
        for token_id, candidates in zip(token_ids, logprobs):
            sampled = candidates.get(token_id)
            token = self.decode_token(token_id, sampled)
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            top = [
                ChatCompletionLogProb(
                    token=(t := self.decode_token(i, c)), logprob=c.logprob, bytes=list(t.encode())
                )
                for i, c in ranked
            ]
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=sampled.logprob if sampled is not None else float("-inf"),
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: Any
    ) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(out.token_ids, out.logprobs or [], request.top_logprobs or 0)
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=ChatMessage(role=ROLE, content=out.text),
                    logprobs=logprobs,
                    finish_reason=out.finish_reason or "stop",
                )
            )
        choices.sort(key=lambda c: c.index)
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int, stream: RequestStream
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            return dump_sse(
                ChatCompletionStreamResponse(
                    id=request_id, model=self.model_name, choices=choices, usage=usage
                )
            )

        states = [_ChoiceState() for _ in range(request.n)]
        completion_tokens = 0
        try:
            # The first delta of every choice carries the role, before any token exists (as OpenAI does).
            for i in range(request.n):
                yield chunk(
                    [ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=ROLE, content=""))]
                )
            async for output in stream:
                for out in output.outputs:
                    state = states[out.index]
                    if state.finished:
                        continue
                    token_ids = list(out.token_ids)
                    new_ids = token_ids[state.num_tokens :]
                    delta = out.text[state.text_len :]
                    logprobs = None
                    if request.logprobs and new_ids:
                        new_lps = (out.logprobs or [])[state.num_tokens : len(token_ids)]
                        logprobs = self._logprobs(new_ids, new_lps, request.top_logprobs or 0)
                    finish = out.finish_reason or ("stop" if output.finished else None)
                    completion_tokens += len(new_ids)
                    state.num_tokens = len(token_ids)
                    state.text_len = len(out.text)
                    if not delta and not finish and logprobs is None:
                        continue
                    state.finished = finish is not None
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index,
                        delta=DeltaMessage(content=delta),
                        logprobs=logprobs,
                        finish_reason=finish,
                    )
                    yield chunk([choice])
            if request.include_usage:
                usage = UsageInfo(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=num_prompt_tokens + completion_tokens,
                )
                yield chunk([], usage)
        except (RequestFailedError, EngineClosedError) as e:
            yield dump_sse(error_body(str(e), 500))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"
