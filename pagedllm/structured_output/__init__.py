"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) that constrain what a request may
sample, on llguidance.

    grammar.py   StructuredOutputsParams -> llguidance grammar text, validated (InputError naming the field)
    manager.py   compiles off the engine step, caches by text, fills each step's token bitmask
"""

from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
