"""StructuredOutputsParams -> an llguidance grammar, checked before a request is accepted.

llguidance was chosen over xgrammar after measuring both on a 2-core Zen 3 with SmolLM2's 49152-token
vocabulary (scripts/bench_grammar_backends.py): a typical nested JSON schema compiles in 1.5-3 ms (xgrammar
12-14 ms), a token mask takes ~40 us (xgrammar ~3 us; both well under 1% of a 32-row decode step), and the
wheel is 8 MB with no dependency, where xgrammar pulls triton (1 GB on disk, no use on a CPU). It also reads
Lark and llama.cpp's GBNF, and it is what vLLM and llama.cpp ship as a grammar backend.
"""

from __future__ import annotations

from functools import lru_cache

import llguidance

from pagedllm.errors import InputError
from pagedllm.sampling_params import StructuredOutputsParams

# The llguidance format each kind is read as; "grammar" accepts Lark and GBNF alike.
_FORMATS = {
    "json": "json_schema",
    "json_object": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; InputError naming structured_outputs.<kind> when it is not
    valid (a malformed schema, regex or grammar)."""
    return _grammar_text(params.kind, params.spec)


@lru_cache(maxsize=512)
def _grammar_text(kind: str, spec: str) -> str:
    param = f"structured_outputs.{kind}"
    try:
        grammar = llguidance.grammar_from(_FORMATS[kind], spec)
    except (ValueError, TypeError) as e:
        raise InputError(f"{param} is not valid: {e}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InputError(f"{param} is not valid: {error.strip()}", param=param)
    return grammar
