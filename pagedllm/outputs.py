"""What the engine hands back per request: RequestOutput holding one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; None when unknown
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the n samples of a request. text and token_ids are cumulative (everything generated so far)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were requested
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life; None until that moment happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """Everything about one request so far. finished is True once every CompletionOutput has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # Per prompt position (the first is None: nothing predicts it), only when prompt_logprobs was asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt tokens whose KV was found computed (prefix cache, or read back from --kv-offload-dir), vLLM's
    # num_cached_tokens: usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: int = 0
