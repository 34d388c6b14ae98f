"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, streamed or not.

Tools: tool_choice "auto" lets the model choose and parses what it wrote (--tool-call-parser);
"required" and a named function are enforced with a grammar (the JSON schema of the allowed calls), so
they hold for any model: "required" makes the model write a JSON list of {"name", "arguments"} objects,
a named function only that function's arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.client_base import RequestStream
from pagedllm.engine.protocol import EngineClient, EngineClosedError, RequestFailedError
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    PromptTokenUsageInfo,
    ToolCall,
    UsageInfo,
    dump_sse,
    random_id,
)
from pagedllm.entrypoints.openai.tool_parsers import JsonToolParser, ParsedCall, ParsedOutput, get_tool_parser
from pagedllm.entrypoints.openai.tool_prompt import conversation, template_takes_tools
from pagedllm.entrypoints.reasoning import ReasoningStream, ThinkState, get_reasoning_parser
from pagedllm.errors import InputError
from pagedllm.sampling_params import StructuredOutputsParams, closed_schema

ROLE = "assistant"
ANY_TEXT = r"(?s:.*)"  # the answer's "constraint" when only a reasoning budget needs the gate
# What the server passes to the chat template itself; chat_template_kwargs may not override them.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "add_special_tokens",
        "tokenize",
        "continue_final_message",
    }
)


@dataclass
class ToolMode:
    kind: str  # none | auto | required | named
    name: str | None = None  # the named function


@dataclass
class _ChoiceState:
    text_len: int = 0  # content characters sent
    num_tokens: int = 0
    finished: bool = False
    call_ids: list[str] = field(default_factory=list)  # tool calls whose header was sent
    call_args_len: list[int] = field(default_factory=list)  # argument characters sent per call
    # with a reasoning parser: the output's split so far (text_len then counts answer characters)
    reasoning: ReasoningStream | None = None
    raw_len: int = 0  # output characters fed to it
    answer: str = ""  # the answer part so far


def forced_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice="required": a JSON list of one call (or several, with parallel_tool_calls) of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: EngineClient,
        served_model_names: Sequence[str],
        tool_call_parser: str = "hermes",
        reasoning_parser: str | None = None,
        enable_in_reasoning: bool = False,
    ):
        super().__init__(engine, served_model_names)
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        # a constraint applies to the whole output, think block included (else only to the answer)
        self.enable_in_reasoning = enable_in_reasoning

    def think_state(self, prompt_token_ids: list[int]) -> ThinkState:
        """Whether the prompt left the output inside a think block ("reasoning"), after one ("content":
        a template with thinking off) or neither (None); None too without a reasoning parser."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(prompt_token_ids[-16:], skip_special_tokens=False)
        return self.reasoning_parser.prompt_state(tail)

    def render_messages(
        self,
        messages: list[ChatMessageParam],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Chat template -> text -> token ids (the template already has the special tokens it wants).
        tools: the tool definitions offered to the model (tool_prompt.py says how they are rendered)."""
        native = template_takes_tools(self.tokenizer.chat_template)
        convo = conversation(messages, tools, native)
        try:
            text = self.tokenizer.apply_chat_template(
                convo,
                add_generation_prompt=add_generation_prompt,
                tools=tools if native else None,
                **template_kwargs,
            )
        except Exception as e:  # templates raise on roles/orders they do not support
            raise InputError(f"cannot apply the chat template: {e}", param="messages") from e
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def reasoning_constraint(
        self,
        request: ChatCompletionRequest,
        think: ThinkState,
        constraint: StructuredOutputsParams | None,
        field: str | None,
    ) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint and its field as the think block changes them: a constraint applies to the answer,
        after the block (vLLM's default; all of the output with enable_in_reasoning), and
        max_reasoning_tokens closes the block for the model once spent (through the same gate, with a
        constraint that allows any answer when the request has none)."""
        budget, parser = request.max_reasoning_tokens, self.reasoning_parser
        if budget is not None and parser is None:
            raise InputError(
                "max_reasoning_tokens needs a server started with --reasoning-parser",
                param="max_reasoning_tokens",
            )
        if parser is None or think == "content":  # no parser, or the prompt turned thinking off
            return constraint, field
        if budget is None and (constraint is None or self.enable_in_reasoning):
            return constraint, field
        if constraint is None:
            constraint, field = StructuredOutputsParams(regex=ANY_TEXT), "max_reasoning_tokens"
        elif self.enable_in_reasoning:  # the constraint covers the block: the forced tag could break it
            raise InputError(
                f"max_reasoning_tokens cannot be combined with {field} when constraints cover the think block "
                "(enable_in_reasoning)",
                param="max_reasoning_tokens",
            )
        return dataclasses.replace(constraint, start_after=parser.end, start_after_budget=budget), field

    @staticmethod
    def tool_mode(request: ChatCompletionRequest) -> ToolMode:
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if request.tools else "none"
        if choice == "none":
            return ToolMode("none")
        if not request.tools:
            raise InputError(
                f"tool_choice {choice if isinstance(choice, str) else 'function'} needs tools",
                param="tool_choice",
            )
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in request.tools]
            if choice.function.name not in names:
                raise InputError(
                    f"tool_choice names {choice.function.name!r}, which is not among the tools "
                    f"({', '.join(names)})",
                    param="tool_choice",
                )
            return ToolMode("named", choice.function.name)
        return ToolMode(choice)

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        self.check_fields(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise InputError("top_logprobs requires logprobs to be true", param="top_logprobs")
        mode = self.tool_mode(request)
        tools = (
            [t.model_dump(exclude_none=True) for t in request.tools or []] if mode.kind != "none" else None
        )
        constraint, field = request.structured_outputs_params()
        if mode.kind in ("required", "named"):
            if constraint is not None:
                raise InputError(
                    f"tool_choice {mode.kind} cannot be combined with {field}", param="tool_choice"
                )
            if mode.kind == "named":
                fn = next(t["function"] for t in tools if t["function"]["name"] == mode.name)
                schema = fn.get("parameters") or {"type": "object", "properties": {}}
            else:
                schema = forced_calls_schema(tools, request.parallel_tool_calls)
            constraint, field = StructuredOutputsParams(json=closed_schema(schema)), "tools"
        template_kwargs = request.chat_template_kwargs or {}
        taken = sorted(set(template_kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise InputError(
                f"chat_template_kwargs may not set {taken[0]!r}: it is a field of the request",
                param="chat_template_kwargs",
            )
        # in a worker thread: a template over megabytes of messages, then their tokenization, take seconds
        token_ids = await asyncio.to_thread(
            self.render_messages,
            request.messages,
            tools,
            add_generation_prompt=request.add_generation_prompt,
            add_special_tokens=request.add_special_tokens,
            continue_final_message=request.continue_final_message,
            **template_kwargs,
        )
        think = self.think_state(token_ids)
        constraint, field = self.reasoning_constraint(request, think, constraint, field)

        max_tokens_param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.resolve_max_tokens(len(token_ids), requested, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = request.make_sampling_params(max_tokens, logprobs, constraint)
        except InputError as e:  # say the field the client sent, not the SamplingParams name
            e.param = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}.get(e.param or "", e.param)
            raise
        self.check_context(len(token_ids), params, max_tokens_param)
        await self.validate_constraint(constraint, field)

        request_id = random_id("chatcmpl")
        (stream,) = await self.add_requests(request_id, [token_ids], params, request.priority, request.model)
        if request.stream:
            return self._stream(request, mode, request_id, len(token_ids), stream, think)
        try:
            (final,) = await last_outputs([stream])
        finally:
            stream.close()
        return self._response(request, mode, request_id, final, think)

    # ------------------------------------------------------------------ tool calls out of the text

    def parse_tools(self, mode: ToolMode, text: str) -> ParsedOutput:
        """Content and tool calls of a (possibly still growing) output."""
        if mode.kind == "named":
            arguments = text.strip()
            try:
                complete = isinstance(json.loads(arguments), dict)
            except ValueError:
                complete = False
            return ParsedOutput("", [ParsedCall(mode.name, arguments, complete)])
        if mode.kind == "required":
            return JsonToolParser().parse(text)
        if mode.kind == "auto":
            return self.tool_parser.parse(text)
        return ParsedOutput(text)

    def _message(
        self, mode: ToolMode, text: str, finish_reason: str, think: ThinkState = None
    ) -> tuple[ChatMessage, str]:
        """The message of a whole output: its think block (with a reasoning parser), then content and
        tool calls out of the answer after it."""
        if self.reasoning_parser is None:
            return self._answer_message(mode, text, finish_reason)
        reasoning, answer = self.reasoning_parser.split(text, think)
        message, finish_reason = self._answer_message(mode, answer, finish_reason)
        message.reasoning_content = reasoning
        if reasoning is not None and not message.content:  # as vLLM: nothing after the block is null
            message.content = None
        return message, finish_reason

    def _answer_message(self, mode: ToolMode, text: str, finish_reason: str) -> tuple[ChatMessage, str]:
        if mode.kind == "none":
            return ChatMessage(role=ROLE, content=text), finish_reason
        parsed = self.parse_tools(mode, text)
        calls = parsed.valid_calls()
        if not calls:
            return ChatMessage(role=ROLE, content=text), finish_reason
        tool_calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        content = parsed.content.strip() or None
        return (
            ChatMessage(role=ROLE, content=content, tool_calls=tool_calls),
            "tool_calls" if finish_reason == "stop" else finish_reason,
        )

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
        self,
        request: ChatCompletionRequest,
        mode: ToolMode,
        request_id: str,
        final: Any,
        think: ThinkState = None,
    ) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(out.token_ids, out.logprobs or [], request.top_logprobs or 0)
            message, finish_reason = self._message(mode, out.text, out.finish_reason or "stop", think)
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=self.prompt_logprobs_field(final, request.prompt_logprobs),
                )
            )
        choices.sort(key=lambda c: c.index)
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=final.num_cached_tokens),
        )
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    def _deltas(self, mode: ToolMode, state: _ChoiceState, text: str, finished: bool) -> DeltaMessage | None:
        """What a streamed choice has not sent yet of `text`: content, then tool-call headers (index, id,
        type, name) as soon as a call's name is complete, then its argument fragments. With a reasoning
        parser the think block's text goes first, and the rest reads only the answer after it."""
        reasoning = None
        if state.reasoning is not None:
            reasoning, text = self._split_delta(state, text, finished)
        if mode.kind == "none":
            content = text
            parsed = None
        else:
            parsed = self.parse_tools(mode, text)
            content = parsed.content
            if finished and not state.call_ids:  # no call came: whatever was held back is content
                content = text
        delta = DeltaMessage()
        if len(content) > state.text_len:
            delta.content = content[state.text_len :]
            state.text_len = len(content)
        for i, call in enumerate(parsed.calls if parsed is not None else []):
            if i == len(state.call_ids):
                if not call.name:
                    break
                state.call_ids.append(random_id("call"))
                state.call_args_len.append(0)
                header = DeltaFunctionCall(name=call.name, arguments="")
                delta.tool_calls = (delta.tool_calls or []) + [
                    DeltaToolCall(index=i, id=state.call_ids[i], type="function", function=header)
                ]
            new = call.arguments[state.call_args_len[i] :]
            if new:
                state.call_args_len[i] = len(call.arguments)
                fragment = DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new))
                delta.tool_calls = (delta.tool_calls or []) + [fragment]
        delta.reasoning_content = reasoning
        if delta.content is None and delta.tool_calls is None and reasoning is None:
            return None
        return delta

    @staticmethod
    def _split_delta(state: _ChoiceState, text: str, finished: bool) -> tuple[str | None, str]:
        """Feed a choice's new output text to its reasoning stream: (the reasoning delta, the answer so far)."""
        assert state.reasoning is not None
        parts = [state.reasoning.feed(text[state.raw_len :])]
        state.raw_len = len(text)
        if finished:
            parts.append(state.reasoning.finish())
        state.answer += "".join(c or "" for _, c in parts)
        return "".join(r or "" for r, _ in parts) or None, state.answer

    async def _stream(
        self,
        request: ChatCompletionRequest,
        mode: ToolMode,
        request_id: str,
        num_prompt_tokens: int,
        stream: RequestStream,
        think: ThinkState = None,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            return dump_sse(
                ChatCompletionStreamResponse(
                    id=request_id, model=self.model_name, choices=choices, usage=usage
                )
            )

        parser = self.reasoning_parser
        states = [_ChoiceState(reasoning=parser.stream(think) if parser else None) for _ in range(request.n)]
        completion_tokens = 0
        cached_tokens = 0
        try:
            # The first delta of every choice carries the role, before any token exists (as OpenAI does).
            for i in range(request.n):
                yield chunk(
                    [ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=ROLE, content=""))]
                )
            async for output in stream:
                cached_tokens = output.num_cached_tokens
                for out in output.outputs:
                    state = states[out.index]
                    if state.finished:
                        continue
                    token_ids = list(out.token_ids)
                    new_ids = token_ids[state.num_tokens :]
                    logprobs = None
                    if request.logprobs and new_ids:
                        new_lps = (out.logprobs or [])[state.num_tokens : len(token_ids)]
                        logprobs = self._logprobs(new_ids, new_lps, request.top_logprobs or 0)
                    finish = out.finish_reason or ("stop" if output.finished else None)
                    completion_tokens += len(new_ids)
                    state.num_tokens = len(token_ids)
                    delta = self._deltas(mode, state, out.text, finish is not None)
                    if delta is None and not finish and logprobs is None:
                        continue
                    state.finished = finish is not None
                    if finish == "stop" and state.call_ids:
                        finish = "tool_calls"
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index,
                        delta=delta or DeltaMessage(content=""),
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=out.stop_reason if finish else None,
                    )
                    yield chunk([choice])
            if request.include_usage:
                usage = UsageInfo(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=num_prompt_tokens + completion_tokens,
                    prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
                )
                yield chunk([], usage)
        except (RequestFailedError, EngineClosedError) as e:
            yield dump_sse(error_body(str(e), 500))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"
