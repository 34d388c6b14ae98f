"""Request and response bodies of the OpenAI-compatible API (the subset pagedllm serves), as pydantic models.

Field names and defaults follow OpenAI's API; vLLM's extras (top_k, min_p, structured_outputs, guided_*,
...) are accepted too. Every field of either API is implemented or, when set to anything but its harmless
default, refused with a 400 naming it (REFUSED); fields neither API knows are ignored with one log line
(unknown_fields), like vLLM does, so newer clients keep working.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.errors import InputError
from pagedllm.sampling_params import (
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutputsParams,
    closed_schema,
)

# OpenAI's own bound on n; beyond it one request would occupy the engine for everyone else.
MAX_N = 128
# The roles OpenAI's chat API defines ("developer" is the newer name of "system").
ROLES = ("system", "developer", "user", "assistant", "tool")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON body that is not valid UTF-8 text (JSON's \\ud800
    escapes decode to lone surrogates, which no tokenizer or template can take), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and first_unencodable(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        where = first_unencodable(item, f"{path}.{key}" if path else str(key))
        if where is not None:
            return where
    return None


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body: no NaN or infinity in any number (Python's JSON reader accepts both), and text that
    encodes as UTF-8; either is a 400 naming the field."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_is_utf8(cls, data: Any) -> Any:
        where = first_unencodable(data)
        if where is not None:
            field = where.split(".")[0]
            raise InputError(f"{where}: text is not valid UTF-8 (a lone surrogate?)", param=field)
        return data


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- shared


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens found computed: prefix cache or --kv-offload-dir


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly, strict or not


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object (its StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Fields of OpenAI's or vLLM's request bodies that pagedllm does not implement, and the values that mean
# "not asked for" (None always does): any other value is a 400 naming the field.
_REFUSED_COMMON: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),  # more candidates than returned: not yet (best_of == n is plain n)
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "allowed_token_ids": (),
    "bad_words": ((), []),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "guided_decoding_backend": ("auto", "llguidance", "guidance"),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": (),
    "prediction": (),
    "web_search_options": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "verbosity": (),
    "functions": (),
    "function_call": (),
}


class _SamplingRequest(OpenAIRequestModel):
    """Fields completions and chat share, and their translation into SamplingParams."""

    # unknown fields are kept (model_extra) so that the server can log them
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # allow_inf_nan=False is inherited
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = _REFUSED_COMMON

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int | None = None  # --scheduling-policy priority: lower first; fcfs refuses all but 0 (engine)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and unused: abuse-monitoring ids and a cache hint (prefix caching is automatic)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # the refused ones (REFUSED), declared so that they are not taken for unknown fields
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = (
        None  # vLLM's: logprobs of the prompt's tokens, in choices[].prompt_logprobs
    )
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: Any = None
    prediction: Any = None
    web_search_options: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    functions: Any = None
    function_call: Any = None

    def check_refused(self) -> None:
        """400 for a field pagedllm does not implement, set to anything but 'not asked for'."""
        for name, harmless in self.REFUSED.items():
            value = getattr(self, name, None)
            if value is None or value in harmless:
                continue
            if name == "best_of" and value == self.n:
                continue
            hint = {
                "best_of": f" (best_of must equal n, {self.n}, or be left out)",
                "functions": ": send tools instead",
                "function_call": ": send tool_choice instead",
            }
            raise InputError(f"{name} is not supported by this server{hint.get(name, '')}", param=name)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for, and the field it came from (for error messages);
        more than one of response_format (other than text), structured_outputs and guided_* is a 400."""
        found: list[tuple[str, StructuredOutputsParams]] = []

        def make(field: str, **kw: Any) -> None:
            try:
                found.append((field, StructuredOutputsParams(**kw)))
            except InputError as e:
                raise InputError(str(e).replace("structured_outputs", field, 1), param=field) from None

        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            make("response_format", json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InputError("response_format.json_schema.schema is required", param="response_format")
            schema = rf.json_schema.json_schema
            make("response_format", json=closed_schema(schema) if rf.json_schema.strict else schema)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            make(
                "structured_outputs",
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            )
        for field, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, field)
            if value is not None:
                if field == "guided_json" and isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except ValueError as e:
                        raise InputError(f"guided_json is not JSON: {e}", param=field) from None
                make(field, **{kind: value})
        if len(found) > 1:
            raise InputError(
                f"only one output constraint per request, got {', '.join(f for f, _ in found)}",
                param=found[1][0],
            )
        return (found[0][1], found[0][0]) if found else (None, None)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise InputError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            out[token_id] = bias  # SamplingParams checks the range, and the vocabulary at add_request
        return out

    def make_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises InputError naming the SamplingParams field that is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingRequest):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None = up to the context length
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # not supported: rejected when set
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's BOS etc. around a text prompt


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's prompt_logprobs entry: one per candidate token id of a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[str, PromptLogprob] | None] | None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- chat


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = takes no arguments
    strict: bool | None = None  # the schema is enforced when a call is forced, strict or not


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ChatMessageParam(OpenAIBaseModel):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message's text; only text content parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InputError(
                    f"only text content parts are supported, got {part.type!r}", param="messages"
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_REFUSED_COMMON,
        "echo": (False,),
        "documents": (),
        "chat_template": (),
        "mm_processor_kwargs": (),
    }

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still widely sent
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = (
        None  # default: auto with tools
    )
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # the chat template already has the special tokens it wants
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # with --reasoning-parser: the most tokens of the think block, after which it is closed for the model
    max_reasoning_tokens: int | None = Field(None, ge=0)
    echo: bool | None = None
    documents: Any = None
    chat_template: str | None = None
    mm_processor_kwargs: Any = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # the think block, with --reasoning-parser (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it (None: EOS)
    prompt_logprobs: PromptLogprobsField = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed tool call: its first delta has index, id, type and name; later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # think-block text, with --reasoning-parser
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequestModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


def dump_sse(chunk: BaseModel | str) -> str:
    """One server-sent event: `data: <json>\n\n`."""
    if isinstance(chunk, BaseModel):
        chunk = chunk.model_dump_json()
    return f"data: {chunk}\n\n"
