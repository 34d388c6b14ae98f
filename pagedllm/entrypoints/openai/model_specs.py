"""Which models one server serves: `--model [NAME=]PATH` (repeatable) and `--models-dir DIR`, and the options
of a server of several models (--load-timeout-s, --max-loaded-models, --idle-unload-s).

A server started with exactly one --model and none of these options is the one-model server it always was
(server.py's plain path); anything else is served by the model router (model_registry.py, model_router.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from pagedllm.errors import InputError

DEFAULT_LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what clients send as `model`
    path: str  # what --model takes: a GGUF file, an HF folder, or "default"


def add_model_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "several models (--model NAME=PATH repeated, or --models-dir; each model has its own engine and KV "
        "cache, --kv-cache-memory / --num-kv-blocks apply to each)"
    )
    g.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every *.gguf file (named by its file name without .gguf) and Hugging Face folder (named "
        "by the folder's name) in DIR; loaded on their first request",
    )
    g.add_argument(
        "--load-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="how long a request waits for its model to load before it gets 503 with Retry-After (the load "
        f"goes on; default: {DEFAULT_LOAD_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="most models loaded at once; loading one more unloads the least recently used one that has no "
        "request in flight (default: no bound)",
    )
    g.add_argument(
        "--idle-unload-s",
        type=float,
        default=None,
        metavar="S",
        help="unload a model that has had no request for S seconds and give its memory (weights, KV cache) "
        "back; its next request loads it again (default: never)",
    )


def parse_model_option(value: str) -> ModelSpec:
    """`NAME=PATH` or `PATH` (named by PATH). A PATH that itself holds '=' and exists is taken whole."""
    name, sep, path = value.partition("=")
    if sep and name and path and "/" not in name and not os.path.exists(value):
        return ModelSpec(name=name, path=path)
    return ModelSpec(name=value, path=value)


def scan_models_dir(directory: str) -> list[ModelSpec]:
    """Every *.gguf file (named without .gguf) and Hugging Face folder (one with a config.json) in it."""
    root = Path(directory)
    if not root.is_dir():
        raise InputError(f"--models-dir {directory!r} is not a directory", param="--models-dir")
    specs = []
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf":
            specs.append(ModelSpec(name=entry.name.removesuffix(".gguf"), path=str(entry)))
        elif entry.is_dir() and (entry / "config.json").is_file():
            specs.append(ModelSpec(name=entry.name, path=str(entry)))
    if not specs:
        raise InputError(
            f"--models-dir {directory!r} holds no *.gguf file and no model folder (one with config.json)",
            param="--models-dir",
        )
    return specs


def model_specs(args: argparse.Namespace) -> list[ModelSpec] | None:
    """The models of a server of several models, checked (InputError naming the option); None for the
    plain one-model server, whose --model may still be NAME=PATH (then args.model and
    args.served_model_name are set from it)."""
    given = list(getattr(args, "models", None) or [args.model])
    models_dir = getattr(args, "models_dir", None)
    routed = len(given) > 1 or models_dir is not None
    routed = routed or any(
        getattr(args, o, None) is not None for o in ("load_timeout_s", "max_loaded_models", "idle_unload_s")
    )
    if not routed:
        spec = parse_model_option(given[0])
        if spec.name != spec.path:
            if args.served_model_name is not None:
                raise InputError(
                    "--served-model-name and --model NAME=PATH both name the model: give one",
                    param="--served-model-name",
                )
            args.model, args.served_model_name = spec.path, spec.name
        return None
    _check_router_options(args)
    # --models-dir alone: --model keeps its default ("default"), which is not one of the served models
    explicit = getattr(args, "models", None)
    specs = [parse_model_option(v) for v in explicit] if explicit or models_dir is None else []
    if models_dir is not None:
        specs += scan_models_dir(models_dir)
    if len(specs) == 1 and args.served_model_name is not None:
        specs = [ModelSpec(name=args.served_model_name, path=specs[0].path)]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InputError(
                f"--model: two models are named {spec.name!r}; give each its own NAME=PATH", param="--model"
            )
        seen.add(spec.name)
    return specs


def _check_router_options(args: argparse.Namespace) -> None:
    several = len(getattr(args, "models", None) or []) > 1 or getattr(args, "models_dir", None) is not None
    if several and args.served_model_name is not None:
        raise InputError(
            "--served-model-name names one model; with several, name each as --model NAME=PATH",
            param="--served-model-name",
        )
    if getattr(args, "data_parallel_size", 1) != 1 or getattr(args, "ray_address", None):
        raise InputError(
            "--data-parallel-size / --ray-address cannot be combined with several models (--model repeated, "
            "--models-dir, --max-loaded-models, --idle-unload-s, --load-timeout-s)",
            param="--data-parallel-size",
        )
    if getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None):
        # each model would need its own adapters; not built yet
        raise InputError(
            "--enable-lora / --lora-modules cannot be combined with several models yet", param="--enable-lora"
        )
    if args.load_timeout_s is None:
        args.load_timeout_s = DEFAULT_LOAD_TIMEOUT_S
    elif not args.load_timeout_s > 0:
        raise InputError(f"--load-timeout-s must be > 0, got {args.load_timeout_s}", param="--load-timeout-s")
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise InputError(
            f"--max-loaded-models must be at least 1, got {args.max_loaded_models}",
            param="--max-loaded-models",
        )
    if args.idle_unload_s is not None and not args.idle_unload_s > 0:
        raise InputError(f"--idle-unload-s must be > 0, got {args.idle_unload_s}", param="--idle-unload-s")
