"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InputError

MAX_LOGPROBS = 20
# A seed is a signed 64-bit integer, as in vLLM; n siblings seed their generators with seed + i (mod 2^64).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.Enum):
    """Which of a request's outputs engine.step() returns (vLLM's names)."""

    CUMULATIVE = 0  # one every step the request advances, with everything generated so far
    FINAL_ONLY = 2  # only the last one, when the request finishes (what offline LLM.generate needs)


def closed_schema(schema: Any) -> Any:
    """The schema with `"additionalProperties": false` on every object that lists properties and does not
    say otherwise: what OpenAI's strict mode means, and what tool arguments mean (a small model given an
    open object keeps inventing keys until max_tokens)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's shape): exactly one of a JSON schema, any JSON object, a regex, a
    choice among strings, or a grammar (Lark, or llama.cpp's GBNF). The engine masks every token that would
    leave the language, and lets the request end exactly when the grammar can."""

    json: str | dict[str, Any] | None = None  # a JSON schema (an object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None  # any JSON object
    # the constraint applies only once the output has contained this text (a reasoning model's </think>:
    # the think block before it is free); None: from the first token
    start_after: str | None = None
    # with start_after: the most tokens before it; once they are spent the output is made to write it
    # (a reasoning budget); None: no bound
    start_after_budget: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InputError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InputError("structured_outputs.choice must be a non-empty list of strings", param="choice")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InputError(f"structured_outputs.{name} must be a non-empty string", param=name)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InputError("structured_outputs.json must be a JSON schema object", param="json")
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise InputError("structured_outputs.start_after must be a non-empty string", param="start_after")
        if self.start_after_budget is not None and (
            self.start_after is None
            or not isinstance(self.start_after_budget, int)
            or self.start_after_budget < 0
        ):
            raise InputError(
                "structured_outputs.start_after_budget must be an integer >= 0, with start_after",
                param="start_after_budget",
            )

    @property
    def kind(self) -> str:
        """json | regex | choice | grammar | json_object."""
        if self.json_object and self.json is None:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one text; (kind, spec) is what the grammar cache is keyed by. A schema keeps its
        key order: the order of "properties" is the order the object's fields are written in."""
        kind = self.kind
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "choice":
            return json.dumps(self.choice)
        value = getattr(self, kind)
        return json.dumps(value) if isinstance(value, dict) else value


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name: str, msg: str) -> InputError:
            return InputError(f"{name} {msg}", param=name)

        # NaN passes every comparison below as "in range" and infinity makes softmax NaN: refuse both first.
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, f"must be an integer, got {v!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise bad("seed", f"must be an integer in [-2^63, 2^63 - 1], got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
            raise bad("output_kind", f"must be one of {kinds}, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "strings must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", f"keys must be non-negative token ids, got {token_id!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {bias!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """What only the model can bound: token ids within its vocabulary, top_k at most its size. Called by
        the engine when the request arrives, so that nothing out of range reaches a batched step."""
        if self.top_k > vocab_size:
            raise InputError(
                f"top_k must be at most the vocabulary size ({vocab_size}), or 0 / -1 (off); got {self.top_k}",
                param="top_k",
            )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise InputError(
                        f"{name}: token id {t} is outside the vocabulary (size {vocab_size})", param=name
                    )
