"""POST /api/chat and /api/generate: each an OpenAI request on the existing path, its stream read back.

/api/chat becomes a /v1/chat/completions request (templates, tools, structured outputs, reasoning), and
/api/generate a /v1/completions request over token ids: the prompt rendered with the chat template as
one user turn (or as it is, with raw), after the `context` of an earlier response. Both are run
streamed, whether or not the client streams, so that the timings Ollama reports (prompt_eval_duration up
to the first token, eval_duration after it) can be measured; a client that does not stream gets the
chunks folded into one body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.ollama.options import OPENAI_TO_OLLAMA, Sampling, sampling_from_options
from pagedllm.entrypoints.openai.ollama.protocol import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaLogprob,
    OllamaMessage,
    OllamaResponseMessage,
    OllamaTokenLogprob,
    OllamaToolCall,
    OllamaToolCallFunction,
    now_ns,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolParam,
    ChatMessageParam,
    CompletionRequest,
    FunctionCall,
)
from pagedllm.entrypoints.openai.protocol import ToolCall as OpenAIToolCall
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.errors import InputError
from pagedllm.sampling_params import MAX_LOGPROBS

logger = logging.getLogger("pagedllm.server")

NDJSON = "application/x-ndjson"


class StreamError(Exception):
    """The OpenAI stream ended in an in-band error (the engine failed after the headers went out)."""


def model_names(served: list[str]) -> dict[str, str]:
    """Every name a client may send -> the served name: Ollama's clients add the tag ":latest"."""
    names = {name: name for name in served}
    names.update({f"{name}:latest": name for name in served if ":" not in name})
    return names


def listed_name(served: str) -> str:
    return served if ":" in served else f"{served}:latest"


def ollama_error(e: InputError, extra: dict[str, str] | None = None) -> InputError:
    """The OpenAI path's error, saying the field as the Ollama client sent it."""
    names = {**OPENAI_TO_OLLAMA, **(extra or {})}
    param = names.get(e.param or "", e.param)
    message = str(e)
    if e.param and param != e.param and param not in message:
        message = message.replace(e.param, param, 1) if e.param in message else f"{param}: {message}"
    return InputError(message, param=param)


def validation_error(e: ValidationError, where: str) -> InputError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return InputError(f"{where}{'.' + loc if loc else ''}: {err.get('msg')}", param=where)


def format_field(fmt: Any) -> dict[str, Any] | None:
    """Ollama's format -> OpenAI's response_format: "json" any JSON object, an object a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    # strict: objects take only the properties they list unless the schema says otherwise, as llama.cpp's
    # schema-to-grammar (Ollama's) reads a schema without additionalProperties
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}


def done_reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason -> Ollama's done_reason (a tool call is a "stop" there)."""
    return "length" if finish_reason == "length" else "stop"


def completion_logprobs(lp: dict[str, Any] | None, top: int) -> list[OllamaLogprob]:
    """OpenAI's completion logprobs (parallel lists; top alternatives as a dict, the sampled token added)
    -> Ollama's entries, the alternatives most likely first."""
    if not lp:
        return []
    out = []
    for token, logprob, alternatives in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        ranked = sorted((alternatives or {}).items(), key=lambda kv: -kv[1])[:top]
        out.append(
            OllamaLogprob(
                token=token,
                logprob=logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    OllamaTokenLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in ranked
                ]
                if top
                else None,
            )
        )
    return out


def ndjson(chunk: BaseModel) -> str:
    return chunk.model_dump_json(exclude_none=True) + "\n"


async def openai_chunks(inner: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent-event stream, up to [DONE]; an in-band error raises."""
    async for event in inner:
        data = event.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamError(chunk["error"].get("message", "the request failed"))
        yield chunk


@dataclass
class Turn:
    """What one response has said so far, and when; filled from the OpenAI chunks as they come."""

    start_ns: int  # the request arrived
    queued_ns: int = 0  # the engine has it
    first_token_ns: int | None = None
    end_ns: int | None = None
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [name, argument text]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[OllamaLogprob] = field(default_factory=list)

    def saw_output(self) -> None:
        if self.first_token_ns is None:
            self.first_token_ns = now_ns()

    def metrics(self) -> dict[str, int]:
        end = self.end_ns or now_ns()
        first = self.first_token_ns or end
        return {
            "total_duration": end - self.start_ns,
            "load_duration": 0,  # the model is loaded when the server starts; no request waits for it
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": max(first - self.queued_ns, 0),
            "eval_count": self.completion_tokens,
            "eval_duration": max(end - first, 0),
        }

    def done_fields(self, fold: bool) -> dict[str, Any]:
        """What the done chunk carries: why it ended, the timings and, folded, every token's logprobs."""
        logprobs = (self.logprobs or None) if fold else None
        return {
            "done": True,
            "done_reason": done_reason(self.finish_reason),
            "logprobs": logprobs,
            **self.metrics(),
        }

    def take_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage["prompt_tokens"]
            self.completion_tokens = usage["completion_tokens"]

    def tool_calls(self) -> list[OllamaToolCall] | None:
        """The calls whose arguments are a JSON object, as Ollama's objects (the others are logged)."""
        out = []
        for index in sorted(self.calls):
            name, arguments = self.calls[index]
            try:
                parsed = json.loads(arguments or "{}")
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                logger.info(
                    "dropping a tool call to %s whose arguments are not an object: %r", name, arguments
                )
                continue
            out.append(
                OllamaToolCall(function=OllamaToolCallFunction(index=len(out), name=name, arguments=parsed))
            )
        return out or None


class OllamaServing:
    def __init__(self, chat: OpenAIServingChat, completions: OpenAIServingCompletion):
        self.chat = chat
        self.completions = completions
        self.names = model_names(chat.served_model_names)

    def served_name(self, model: str) -> str:
        """The served model a request names; 404 in Ollama's words for any other."""
        if not model:
            raise InputError("model is required", param="model")
        if model not in self.names:
            raise APIError(f'model "{model}" not found, try pulling it first', status=404, param="model")
        return self.names[model]

    @property
    def thinks(self) -> bool:
        """The chat path splits a reasoning model's think block into reasoning_content
        (--reasoning-parser): then, and only then, Ollama's `think` can be honoured."""
        return getattr(self.chat, "reasoning_parser", None) is not None

    @staticmethod
    def check_common(request: OllamaChatRequest | OllamaGenerateRequest) -> None:
        unknown = request.unknown_fields()
        if unknown:
            logger.info("ignoring unknown Ollama request fields: %s", ", ".join(unknown))
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise InputError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        if request.top_logprobs and not request.logprobs:
            raise InputError("top_logprobs requires logprobs to be true", param="top_logprobs")
        # keep_alive: how long Ollama keeps a model loaded after the request; this server's model stays
        # loaded while it runs, which any keep_alive is satisfied by (0 asks for an unload, which a server
        # of one model has no use for), so it is accepted and has nothing to do

    def template_kwargs(self, think: Any) -> dict[str, Any]:
        """Ollama's think -> the chat template's variables (Qwen3's enable_thinking, gpt-oss' level)."""
        if think is None:
            return {}
        if think is not False and not self.thinks:
            raise InputError(f'"{self.chat.model_name}" does not support thinking', param="think")
        kwargs: dict[str, Any] = {"enable_thinking": think is not False}
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        return kwargs

    def context_cap(self, sampling: Sampling, num_prompt_tokens: int) -> int | None:
        """max_tokens under options.num_ctx: the context Ollama would give this request (clamped, as Ollama
        clamps it, to the model's). A prompt that does not fit is refused; Ollama would cut it."""
        if sampling.num_ctx is None or sampling.num_ctx >= self.chat.max_model_len:
            return sampling.max_tokens
        room = sampling.num_ctx - num_prompt_tokens
        if room < 1:
            raise InputError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves nothing to generate in "
                f"options.num_ctx {sampling.num_ctx}",
                param="options.num_ctx",
            )
        return room if sampling.max_tokens is None else min(room, sampling.max_tokens)

    # ------------------------------------------------------------------ /api/chat

    @staticmethod
    def openai_messages(messages: list[OllamaMessage]) -> list[ChatMessageParam]:
        out = []
        for i, m in enumerate(messages):
            if m.images:
                raise InputError(f"messages[{i}].images: this model does not take images", param="messages")
            calls = [
                OpenAIToolCall(
                    function=FunctionCall(name=c.function.name, arguments=json.dumps(c.function.arguments))
                )
                for c in m.tool_calls or []
            ]
            out.append(
                ChatMessageParam(
                    role=m.role,
                    content=m.content,
                    tool_calls=calls or None,
                    name=m.tool_name if m.role == "tool" else None,
                )
            )
        return out

    async def create_chat(self, request: OllamaChatRequest) -> OllamaChatResponse | AsyncIterator[str]:
        start = now_ns()
        model = self.served_name(request.model)
        self.check_common(request)
        if not request.messages:  # Ollama's way to load a model: nothing to say, done at once
            return OllamaChatResponse(
                model=request.model, message=OllamaResponseMessage(), done=True, done_reason="load"
            )
        sampling = sampling_from_options(request.options)
        messages = self.openai_messages(request.messages)
        try:
            tools = [ChatCompletionToolParam.model_validate(t.model_dump()) for t in request.tools or []]
        except ValidationError as e:
            raise validation_error(e, "tools") from None
        template_kwargs = self.template_kwargs(request.think)
        max_tokens = sampling.max_tokens
        if sampling.num_ctx is not None:
            tool_dicts = [t.model_dump(exclude_none=True) for t in tools] or None
            ids = await asyncio.to_thread(self.chat.render_messages, messages, tool_dicts, **template_kwargs)
            max_tokens = self.context_cap(sampling, len(ids))
        body = {
            "model": model,
            "messages": messages,
            "tools": tools or None,
            "max_tokens": max_tokens,
            "response_format": format_field(request.format),
            "chat_template_kwargs": template_kwargs or None,
            "logprobs": bool(request.logprobs),
            "top_logprobs": request.top_logprobs if request.logprobs else None,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling.fields,
        }
        try:
            inner = await self.chat.create_chat_completion(ChatCompletionRequest.model_validate(body))
        except InputError as e:
            raise ollama_error(e) from None
        except ValidationError as e:
            raise validation_error(e, "options") from None
        turn = Turn(start_ns=start, queued_ns=now_ns())
        chunks = self._chat_chunks(inner, turn, request.model)
        return await self._respond(
            request.stream, chunks, lambda fold: self._chat_done(request.model, turn, fold)
        )

    async def _chat_chunks(
        self, inner: AsyncIterator[str], turn: Turn, model: str
    ) -> AsyncIterator[OllamaChatResponse]:
        """Ollama's chat chunks from the OpenAI ones: text and thinking as they come, then the tool calls
        once complete (Ollama sends each call whole)."""
        async with aclosing(inner):
            async for chunk in openai_chunks(inner):
                turn.take_usage(chunk)
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    thinking = delta.get("reasoning_content") or ""
                    for call in delta.get("tool_calls") or []:
                        entry = turn.calls.setdefault(call["index"], ["", ""])
                        fn = call.get("function") or {}
                        entry[0] += fn.get("name") or ""
                        entry[1] += fn.get("arguments") or ""
                    if text or thinking or delta.get("tool_calls") or choice.get("finish_reason"):
                        turn.saw_output()
                    turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
                    # OpenAI's chat logprobs entries have Ollama's shape already
                    logprobs = [
                        OllamaLogprob(**e) for e in (choice.get("logprobs") or {}).get("content") or []
                    ]
                    turn.logprobs += logprobs
                    if text or thinking or logprobs:
                        turn.text.append(text)
                        turn.thinking.append(thinking)
                        message = OllamaResponseMessage(content=text, thinking=thinking or None)
                        yield OllamaChatResponse(
                            model=model, message=message, done=False, logprobs=logprobs or None
                        )
        turn.end_ns = now_ns()
        calls = turn.tool_calls()
        if calls:
            yield OllamaChatResponse(model=model, message=OllamaResponseMessage(tool_calls=calls), done=False)

    def _chat_done(self, model: str, turn: Turn, fold: bool) -> OllamaChatResponse:
        """The last chunk; fold: the whole response in it (a client that does not stream)."""
        message = OllamaResponseMessage()
        if fold:
            thinking = "".join(turn.thinking)
            message = OllamaResponseMessage(
                content="".join(turn.text), thinking=thinking or None, tool_calls=turn.tool_calls()
            )
        return OllamaChatResponse(model=model, message=message, **turn.done_fields(fold))

    # ------------------------------------------------------------------ /api/generate

    def generate_prompt(self, request: OllamaGenerateRequest) -> list[int]:
        """The token ids to continue: `context`, then the prompt (templated as one user turn unless raw)."""
        for name in ("suffix", "template"):
            if getattr(request, name):
                raise InputError(
                    f"{name} is not supported by this server (the model's own chat template is used)",
                    param=name,
                )
        if request.images:
            raise InputError("images: this model does not take images", param="images")
        if request.width or request.height or request.steps:
            raise InputError("image generation (width, height, steps) is not supported", param="width")
        if request.think not in (None, False):
            raise InputError("think is supported on /api/chat only (reasoning_content)", param="think")
        context = list(request.context or [])
        self.completions.check_token_ids(context, "context")
        if request.raw:
            if request.system:
                raise InputError("system has no effect with raw: the prompt is used as it is", param="system")
            ids = self.completions.tokenizer.encode(request.prompt, add_special_tokens=not context)
            return context + ids
        messages = [ChatMessageParam(role="system", content=request.system)] if request.system else []
        messages.append(ChatMessageParam(role="user", content=request.prompt))
        template_kwargs = {"enable_thinking": False} if request.think is False else {}
        try:
            ids = self.chat.render_messages(messages, None, **template_kwargs)
        except InputError as e:
            raise InputError(str(e), param="prompt") from None
        return context + ids

    async def create_generate(
        self, request: OllamaGenerateRequest
    ) -> OllamaGenerateResponse | AsyncIterator[str]:
        start = now_ns()
        model = self.served_name(request.model)
        self.check_common(request)
        if not request.prompt and not request.context:
            return OllamaGenerateResponse(model=request.model, response="", done=True, done_reason="load")
        sampling = sampling_from_options(request.options)
        # in a worker thread, as the chat path does: the template and tokenizer over a long prompt take time
        prompt = await asyncio.to_thread(self.generate_prompt, request)
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.context_cap(sampling, len(prompt)),
            "response_format": format_field(request.format),
            "logprobs": (request.top_logprobs or 0) if request.logprobs else None,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling.fields,
        }
        try:
            inner = await self.completions.create_completion(CompletionRequest.model_validate(body))
        except InputError as e:
            raise ollama_error(e, {"prompt": "prompt"}) from None
        except ValidationError as e:
            raise validation_error(e, "options") from None
        turn = Turn(start_ns=start, queued_ns=now_ns())
        chunks = self._generate_chunks(inner, turn, request.model, request.top_logprobs or 0)
        return await self._respond(
            request.stream, chunks, lambda fold: self._generate_done(request.model, turn, prompt, fold)
        )

    async def _generate_chunks(
        self, inner: AsyncIterator[str], turn: Turn, model: str, top: int
    ) -> AsyncIterator[OllamaGenerateResponse]:
        async with aclosing(inner):
            async for chunk in openai_chunks(inner):
                turn.take_usage(chunk)
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or ""
                    if text or choice.get("finish_reason"):
                        turn.saw_output()
                    turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
                    logprobs = completion_logprobs(choice.get("logprobs"), top)
                    turn.logprobs += logprobs
                    if text or logprobs:
                        turn.text.append(text)
                        yield OllamaGenerateResponse(
                            model=model, response=text, done=False, logprobs=logprobs or None
                        )
        turn.end_ns = now_ns()

    def _generate_done(self, model: str, turn: Turn, prompt: list[int], fold: bool) -> OllamaGenerateResponse:
        text = "".join(turn.text)
        # the conversation so far as token ids, for the client's next `context` (Ollama's are the ids it
        # ran; the text is encoded again here, which gives the same text back)
        context = prompt + self.completions.tokenizer.encode(text, add_special_tokens=False)
        return OllamaGenerateResponse(
            model=model, response=text if fold else "", context=context, **turn.done_fields(fold)
        )

    # ------------------------------------------------------------------ streamed or folded

    @staticmethod
    async def _respond(
        stream: bool, chunks: AsyncIterator[BaseModel], done: Callable[[bool], BaseModel]
    ) -> BaseModel | AsyncIterator[str]:
        """Streamed: the chunks, then done(False), one JSON object a line. Not: the chunks run to the end
        and done(True) holds the whole response."""
        if stream:
            return _ndjson(chunks, done)
        async with aclosing(chunks):
            async for _ in chunks:
                pass
        return done(True)


async def _ndjson(chunks: AsyncIterator[BaseModel], done: Callable[[bool], BaseModel]) -> AsyncIterator[str]:
    """A failure after the headers went out is a last {"error": ...} line, which Ollama's clients raise."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield ndjson(chunk)
        except StreamError as e:
            yield json.dumps({"error": str(e)}) + "\n"
            return
    yield ndjson(done(False))
