"""`--structured-outputs-config`: vLLM's StructuredOutputsConfig, as a JSON object, for the keys that mean
something here; any other key is refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedllm.errors import InputError

FLAG = "--structured-outputs-config"
# vLLM's backend names for the one backend there is (llguidance, which vLLM calls "guidance")
BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    # with a reasoning parser: the constraint applies to the whole output, think block included, instead of
    # only to the answer after it
    enable_in_reasoning: bool = False
    backend: str = "auto"
    reasoning_parser: str | None = None  # vLLM's place for --reasoning-parser; either may say it


def parse_structured_outputs_config(text: str | None) -> StructuredOutputsConfig:
    """The flag's JSON object; InputError naming the flag for bad JSON, a key not served or a bad value."""
    if not text:
        return StructuredOutputsConfig()
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InputError(f"{FLAG} is not JSON: {e}", param=FLAG) from None
    if not isinstance(raw, dict):
        raise InputError(f"{FLAG} must be a JSON object, got {text!r}", param=FLAG)
    known = StructuredOutputsConfig.__dataclass_fields__
    for key in raw:
        if key not in known:
            raise InputError(f"{FLAG}: {key!r} is not supported (supported: {', '.join(known)})", param=FLAG)
    if not isinstance(raw.get("enable_in_reasoning", False), bool):
        raise InputError(f"{FLAG}: enable_in_reasoning must be true or false", param=FLAG)
    if raw.get("backend", "auto") not in BACKENDS:
        raise InputError(
            f"{FLAG}: backend {raw['backend']!r} is not available (only llguidance: {', '.join(BACKENDS)})",
            param=FLAG,
        )
    if not isinstance(raw.get("reasoning_parser") or "", str):
        raise InputError(f"{FLAG}: reasoning_parser must be a parser's name", param=FLAG)
    return StructuredOutputsConfig(**raw)
