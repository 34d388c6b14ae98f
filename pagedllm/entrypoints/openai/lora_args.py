"""The server's LoRA options (issue 37; lora_serving.py serves them): light, so that `--help` imports no
torch and no web framework."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.errors import InputError


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (PEFT folders over the base model)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve: a request's model field NAME runs the PEFT folder PATH",
    )
    g.add_argument(
        "--max-loras", type=int, default=None, help="adapters that may run in one step (default: 1)"
    )
    g.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank taken (default: 16)")
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in memory, least recently used out (default: --max-loras)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime updating)",
    )


LORA_OPTIONS = ("lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "allow_runtime_lora_updating")


def lora_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine keywords of the LoRA options; without --enable-lora any of them is refused by name."""
    if not getattr(args, "enable_lora", False):
        for dest in LORA_OPTIONS:
            if getattr(args, dest, None) not in (None, False):
                flag = "--" + dest.replace("_", "-")
                raise InputError(f"{flag} needs --enable-lora", param=flag)
        return {}
    if getattr(args, "data_parallel_size", 1) > 1 or getattr(args, "ray_address", None):
        raise InputError(
            "--enable-lora is not supported with --data-parallel-size / --ray-address yet",
            param="--enable-lora",
        )
    kwargs: dict[str, Any] = {"enable_lora": True}
    for dest in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, dest, None) is not None:
            kwargs[dest] = getattr(args, dest)
    return kwargs


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--lora-modules takes NAME=PATH, got {value!r}", param="--lora-modules")
        out.append((name, path))
    return out
