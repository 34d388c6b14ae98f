"""The JSON-schema workload of `pagedllm bench throughput --json-schema builtin`: a list of person records,
a typical schema (nested object, enum, integer range, string pattern, array with minItems) whose list
is long enough (minItems) that no request can end it within a benchmark's max_tokens: constrained and
unconstrained runs then generate the same number of tokens, and their rates compare."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pagedllm.errors import InputError

BUILTIN_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "zip": {"type": "string"}},
                "required": ["city"],
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1},
        },
        "required": ["name", "age", "role"],
    },
}


def load_schema(arg: str) -> dict[str, Any]:
    """--json-schema: "builtin" or a file holding a JSON schema."""
    if arg == "builtin":
        return BUILTIN_SCHEMA
    path = Path(arg)
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--json-schema {arg}: {e}", param="json_schema") from None
    if not isinstance(schema, dict):
        raise InputError(f"--json-schema {arg}: a JSON schema is an object", param="json_schema")
    return schema


def compile_times(engine, params) -> dict[str, float]:
    """Seconds to index the tokenizer (once per engine) and to compile the schema (once per schema text)."""
    manager = engine.structured_output
    start = time.perf_counter()
    manager.ll_tokenizer()
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.request(params).future.result()
    return {"grammar_tokenizer_s": tokenizer_s, "grammar_compile_s": time.perf_counter() - start}
