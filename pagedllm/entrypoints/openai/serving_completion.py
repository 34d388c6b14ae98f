"""POST /v1/completions: one or a batch of prompts (text or token ids), streamed or not.

Each prompt is one engine request with params.n choices; choice `i` of prompt `p` gets index p * n + i
in the response, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.protocol import EngineClosedError, RequestFailedError
from pagedllm.entrypoints.openai import OpenAIServing, last_outputs, merge_streams
from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptTokenUsageInfo,
    UsageInfo,
    dump_sse,
    random_id,
)
from pagedllm.errors import InputError


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None  # what echo repeats; None until needed for token-id prompts


@dataclass
class _ChoiceState:
    """What a streamed choice has sent so far, so each chunk carries only the new part."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # for logprobs.text_offset
    echoed: bool = False
    finished: bool = False
    logprobs: CompletionLogProbs = field(default_factory=CompletionLogProbs)


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        p = request.prompt
        if isinstance(p, str):
            raw: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]  # type: ignore[arg-type]
        else:
            raw = list(p)  # type: ignore[arg-type]
        if not raw:
            raise InputError("prompt must not be empty", param="prompt")
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                prompts.append(_Prompt(ids, item))
            else:
                self.check_token_ids(item, "prompt")
                prompts.append(_Prompt(list(item), None))
        return prompts

    def _echo_text(self, prompt: _Prompt, request: CompletionRequest) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(
                prompt.token_ids, skip_special_tokens=request.skip_special_tokens
            )
        return prompt.text

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        self.check_fields(request)
        if request.suffix:
            raise InputError("suffix is not supported", param="suffix")
        constraint, field = request.structured_outputs_params()
        # in a worker thread: tokenizing megabytes takes seconds (the tokenizer releases the GIL)
        prompts = await asyncio.to_thread(self._prompts, request)
        # echo with max_tokens=0 scores the prompt without generating (the older scoring idiom): the
        # engine samples one token, which the response leaves out
        score_only = request.echo and request.max_tokens == 0
        # One SamplingParams for the batch: a default max_tokens follows the longest prompt.
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = self.resolve_max_tokens(longest, 1 if score_only else request.max_tokens, "prompt")
        # echo + logprobs: the prompt's tokens come back with their logprobs too (prompt_logprobs)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        params = request.make_sampling_params(max_tokens, request.logprobs, constraint, prompt_logprobs)
        await self.validate_constraint(constraint, field)
        self.check_context(longest, params, "max_tokens")

        request_id = random_id("cmpl")
        streams = await self.add_requests(
            request_id, [p.token_ids for p in prompts], params, request.priority, request.model
        )
        if request.stream:
            return self._stream(request, request_id, prompts, streams, score_only)
        try:
            finals = await last_outputs(streams)
        finally:
            for stream in streams:
                stream.close()
        return self._response(request, request_id, prompts, finals, score_only)

    # ------------------------------------------------------------------ logprobs

    def _append_logprobs(
        self,
        lp: CompletionLogProbs,
        token_ids: list[int],
        logprobs: list[dict[int, Any]],
        num_top: int,
        offset: int,
    ) -> int:
        """Add one entry per token to `lp`; returns the text offset after them."""
        for token_id, candidates in zip(token_ids, logprobs):
            sampled = candidates.get(token_id)
            token = self.decode_token(token_id, sampled)
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            top = {self.decode_token(t, c): c.logprob for t, c in ranked}
            if sampled is not None:
                top.setdefault(token, sampled.logprob)
            lp.tokens.append(token)
            lp.token_logprobs.append(sampled.logprob if sampled is not None else None)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(token)
        return offset

    def _append_prompt_logprobs(
        self, lp: CompletionLogProbs, prompt: _Prompt, prompt_logprobs: list | None, num_top: int
    ) -> int:
        """echo + logprobs: the prompt's tokens, each with its logprob and top alternatives; the first has
        none (null, as OpenAI's API had it: nothing predicts it). Returns the text offset after them."""
        lp.tokens.append(self.decode_token(prompt.token_ids[0]))
        lp.token_logprobs.append(None)
        lp.top_logprobs.append(None)
        lp.text_offset.append(0)
        offset = len(lp.tokens[-1])
        return self._append_logprobs(
            lp, prompt.token_ids[1:], (prompt_logprobs or [None])[1:], num_top, offset
        )

    # ------------------------------------------------------------------ non-streaming

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        finals: list[Any],
        score_only: bool = False,
    ) -> CompletionResponse:
        n = request.n
        choices = []
        completion_tokens = 0
        for p_idx, (prompt, final) in enumerate(zip(prompts, finals)):
            for out in final.outputs:
                token_ids, text, out_logprobs = out.token_ids, out.text, out.logprobs or []
                finish_reason = out.finish_reason or "stop"
                if score_only:
                    token_ids, text, out_logprobs, finish_reason = [], "", [], "length"
                completion_tokens += len(token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    offset = 0
                    if request.echo:
                        offset = self._append_prompt_logprobs(
                            logprobs, prompt, final.prompt_logprobs, request.logprobs
                        )
                    self._append_logprobs(logprobs, token_ids, out_logprobs, request.logprobs, offset)
                if request.echo:
                    text = self._echo_text(prompt, request) + text
                choices.append(
                    CompletionResponseChoice(
                        index=p_idx * n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        prompt_logprobs=self.prompt_logprobs_field(final, request.prompt_logprobs),
                    )
                )
        choices.sort(key=lambda c: c.index)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        cached_tokens = sum(f.num_cached_tokens for f in finals)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
        )
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        streams: list,
        score_only: bool = False,
    ) -> AsyncIterator[str]:
        n = request.n
        states: dict[int, _ChoiceState] = {}
        completion_tokens = 0
        cached_tokens: dict[int, int] = {}  # per prompt, from its latest output
        try:
            async for p_idx, output in merge_streams(streams):
                cached_tokens[p_idx] = output.num_cached_tokens
                chunks = []
                for out in output.outputs:
                    index = p_idx * n + out.index
                    state = states.setdefault(index, _ChoiceState())
                    if state.finished:
                        continue
                    token_ids = [] if score_only else list(out.token_ids)
                    new_ids = token_ids[state.num_tokens :]
                    delta = "" if score_only else out.text[state.text_len :]
                    lp = None
                    if request.logprobs is not None:
                        lp = CompletionLogProbs()
                        if request.echo and not state.echoed:
                            state.text_offset = self._append_prompt_logprobs(
                                lp, prompts[p_idx], output.prompt_logprobs, request.logprobs
                            )
                        new_lps = (out.logprobs or [])[state.num_tokens : len(token_ids)]
                        state.text_offset = self._append_logprobs(
                            lp, new_ids, new_lps, request.logprobs, state.text_offset
                        )
                    if request.echo and not state.echoed:
                        delta = self._echo_text(prompts[p_idx], request) + delta
                        state.echoed = True
                    finish = out.finish_reason or ("stop" if output.finished else None)
                    if score_only and finish is not None:
                        finish = "length"
                    completion_tokens += len(new_ids)
                    state.num_tokens = len(token_ids)
                    state.text_len = len(out.text)
                    if not delta and not finish and not (lp and lp.tokens):
                        continue  # nothing new to say (e.g. a token still mid-UTF-8)
                    state.finished = finish is not None
                    chunks.append(
                        CompletionResponseChoice(index=index, text=delta, logprobs=lp, finish_reason=finish)
                    )
                for choice in chunks:  # one event per choice, like vLLM
                    chunk = CompletionStreamResponse(id=request_id, model=self.model_name, choices=[choice])
                    yield dump_sse(chunk)
            if request.include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                usage = UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                    prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sum(cached_tokens.values())),
                )
                yield dump_sse(
                    CompletionStreamResponse(id=request_id, model=self.model_name, choices=[], usage=usage)
                )
        except (RequestFailedError, EngineClosedError) as e:
            # Headers are already sent: report the failure in-band, like vLLM.
            yield dump_sse(error_body(str(e), 500))
        finally:
            for stream in streams:
                stream.close()  # no-op when finished; aborts on client disconnect (cancellation)
        yield "data: [DONE]\n\n"
