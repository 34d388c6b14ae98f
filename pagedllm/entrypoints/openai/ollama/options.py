"""Ollama's `options` object -> the sampling fields of the OpenAI request the chat / completion path takes.

Ollama's options are its api/types.go `Options` (with `Runner`); it decodes them with FromMap, which logs
"invalid option provided" for a name it does not know and goes on. pagedllm does the same for those
names (tfs_z, mirostat, penalize_newline, numa, ... are such names today: Ollama dropped them), so a
client written for an older Ollama keeps working. Every name Ollama does know is either mapped here, or
refused by name with a 400 where this engine cannot do what it asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InputError

logger = logging.getLogger("pagedllm.server")

# Ollama's own defaults (api.DefaultOptions) where the engine's differ: a client of Ollama that sends no
# options expects these. repeat_penalty is not among them: Ollama's 1.1 applies over the last 64 tokens
# (repeat_last_n), this engine's over the whole context, so its default stays off (1.0).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# option -> the OpenAI request field it sets, unchanged
_DIRECT = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_PENALTIES = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # their "off"
# How Ollama's runner is laid out on the hardware (threads, GPU layers, batch, mmap): they change how fast,
# never what is generated. This server's are fixed when it starts (`pagedllm serve` flags); accepted and
# logged, as refusing them would turn away every client that tunes a GPU it does not know is absent.
_RUNNER = frozenset({"num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"})
_INTS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "seed",
                   "num_predict", "top_k", "repeat_last_n"})  # fmt: skip
_FLOATS = frozenset({"temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"})  # fmt: skip
KNOWN = _INTS | _FLOATS | {"use_mmap", "stop"}

# the OpenAI request field an InputError names -> the Ollama field the client sent
OPENAI_TO_OLLAMA = {
    **{openai: f"options.{ollama}" for ollama, openai in _DIRECT.items()},
    "seed": "options.seed",
    "stop": "options.stop",
    "max_tokens": "options.num_predict",
    "response_format": "format",
}


@dataclass
class Sampling:
    fields: dict[str, Any] = field(default_factory=dict)  # OpenAI request fields
    max_tokens: int | None = None  # from num_predict; None = up to the context
    num_ctx: int | None = None  # the context the client asked for (serving.py caps the request to it)


def _typed(name: str, value: Any) -> Any:
    """Ollama's FromMap type checks and messages; an integral float is an int (JSON numbers are floats)."""
    bad = InputError  # Ollama's own messages, with the field named
    if name in _INTS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad(f'option "{name}" must be of type integer', param=f"options.{name}")
    elif name in _FLOATS:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad(f'option "{name}" must be of type float32', param=f"options.{name}")
        value = float(value)
    elif name == "use_mmap":
        if not isinstance(value, bool):
            raise bad(f'option "{name}" must be of type boolean', param=f"options.{name}")
    elif name == "stop":
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise bad(f'option "{name}" must be of an array of strings', param=f"options.{name}")
    return value


def sampling_from_options(options: dict[str, Any] | None) -> Sampling:
    opts: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name not in KNOWN:
            logger.warning("ignoring Ollama option %r (Ollama does not know it either)", name)
        elif value is not None:  # Ollama skips a null option
            opts[name] = _typed(name, value)
    ignored = sorted(set(opts) & _RUNNER)
    if ignored:
        logger.info("Ollama runner options set by the server's own flags, ignored: %s", ", ".join(ignored))
    _repeat_window(opts)

    out = Sampling()
    for name, value in {**DEFAULTS, **opts}.items():
        if name in _DIRECT:
            out.fields[_DIRECT[name]] = value
    if "seed" in opts and opts["seed"] != -1:  # -1: Ollama's "no seed"
        out.fields["seed"] = opts["seed"]
    if opts.get("stop"):
        out.fields["stop"] = opts["stop"]
    # num_predict: -1 (Ollama's default) is "until done", -2 "until the context is full", and the runner
    # stops early only for a positive count: all of those are the chat path's default, up to the context
    if opts.get("num_predict", 0) > 0:
        out.max_tokens = opts["num_predict"]
    if "num_ctx" in opts:
        if opts["num_ctx"] < 1:
            raise InputError("options.num_ctx must be at least 1", param="options.num_ctx")
        out.num_ctx = opts["num_ctx"]
    if opts.get("typical_p", 1.0) < 1.0:  # 1 (Ollama's default) and above: off
        raise InputError(
            "options.typical_p is not supported by this server (leave it out, or 1.0)",
            param="options.typical_p",
        )
    # num_keep says which prompt tokens survive when Ollama shifts a full context; this server never
    # shifts (a request that does not fit is refused), so it has nothing to act on
    return out


def _repeat_window(opts: dict[str, Any]) -> None:
    """repeat_last_n is the window the penalties look back over: -1 (the whole context) is what this
    engine does; 0 turns them off, which with no penalty set is what they already are. A finite window
    with a penalty on cannot be honoured, so it is refused rather than widened silently."""
    window = opts.get("repeat_last_n")
    if window is None or window == -1:
        return
    active = [p for p, off in _PENALTIES.items() if opts.get(p, off) != off]
    if window == 0 and active:
        for p in active:  # 0: penalties off, whatever they are set to
            opts[p] = _PENALTIES[p]
        return
    if active:
        raise InputError(
            f"options.repeat_last_n {window} is not supported with {active[0]}: the penalties here apply "
            "over the whole context (send -1, or leave repeat_last_n out)",
            param="options.repeat_last_n",
        )
