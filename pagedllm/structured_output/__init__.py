"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) that constrain what a request may
sample, on llguidance.

    grammar.py   StructuredOutputsParams -> llguidance grammar text, validated (InputError naming the field)
    manager.py   compiles off the engine step, caches by text, fills each step's token bitmask
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]


def __getattr__(name: str):
    # imported on first use: the manager imports torch, and the CLI's parser reads config.py (the
    # --structured-outputs-config flag) without it (`pagedllm --help` / `plan` stay quick)
    if name in __all__:
        from pagedllm.structured_output import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
