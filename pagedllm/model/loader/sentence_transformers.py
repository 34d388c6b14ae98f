"""Whether a checkpoint is a pooling model (an embedder or a cross-encoder), and how it pools: plain data read
from a sentence-transformers folder or config.json, no tensors.

A sentence-transformers folder has modules.json (the pipeline: Transformer, Pooling, optional Normalize),
the pooling config in its Pooling module's folder, and its max length. Two layouts are in use:
  - the hub's (sentence-transformers 2-3): module types `sentence_transformers.models.Pooling`, pooling as
    booleans (`pooling_mode_mean_tokens: true`, `word_embedding_dimension`), `max_seq_length` in
    sentence_bert_config.json;
  - the one sentence-transformers 6's save() writes: types under `sentence_transformers.base.modules...`,
    `pooling_mode: "cls"` and `embedding_dimension`, the max length in the tokenizer's model_max_length.
Without one, config.json decides: an encoder (BertModel, XLMRobertaModel) embeds with CLS pooling, a
*ForSequenceClassification encoder is a cross-encoder, a decoder's base model (Qwen3Model) embeds with
last-token pooling, and so does any registry decoder under `--runner pooling` (vLLM's flag).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import InputError
from pagedllm.model.loader import registry

ENCODER_CLASS = "EncoderModel"  # registry.Architecture.model_class of the encoders (model/encoder.py)
RUNNERS = ("auto", "generate", "pooling")
# the legacy boolean keys of a Pooling config -> the mode (sentence-transformers' own table)
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SUPPORTED_MODES = ("cls", "mean", "max", "lasttoken")
# sentence-transformers module types by their last name (both layouts' module paths end in it)
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Sigmoid"


@dataclass(frozen=True)
class PoolingSpec:
    task: str  # "embed" or "score" (a cross-encoder)
    model_folder: Path  # the folder of the transformer's config.json and weights
    encoder: bool  # model/encoder.py, else a registry decoder (model/llama.py)
    pooling_type: str  # model/pooling.py's POOLING_TYPES (a cross-encoder: its head reads the first token)
    normalize: bool
    max_model_len: int | None  # the folder's limit (max_seq_length / model_max_length); None: the model's
    matryoshka_dimensions: tuple[int, ...] | None  # None: `dimensions` is refused; () any size up to full
    activation: str | None = None  # a cross-encoder's: CrossEncoder.predict's activation on the logits
    prompt: str = ""  # config_sentence_transformers.json's default prompt, put before every text


def _json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {file}: {e}", param="model") from None


def is_encoder_config(cfg: dict[str, Any]) -> bool:
    arch = registry.hf_architecture_name(cfg)
    try:
        return registry.from_hf(arch, "config.json").model_class == ENCODER_CLASS
    except InputError:
        return False


def pooling_spec(path: Path, runner: str = "auto") -> PoolingSpec | None:
    """The pooling model `path` holds, or None for a generative model (`runner` "generate" forces None,
    "pooling" forces a decoder to pool)."""
    if runner not in RUNNERS:
        raise InputError(f"runner {runner!r} is not one of {', '.join(RUNNERS)}", param="runner")
    if runner == "generate":
        return None
    if not path.is_dir() or not (path / "config.json").is_file():
        if runner == "pooling":
            raise InputError(f"--runner pooling needs a Hugging Face model folder; {path} is not", "runner")
        return None
    if (path / "modules.json").is_file():
        return _from_sentence_transformers(path)
    return _from_config(path, _json(path / "config.json"), runner == "pooling")


def _from_config(folder: Path, cfg: dict[str, Any], forced: bool) -> PoolingSpec | None:
    arch = registry.hf_architecture_name(cfg) or ""
    encoder = is_encoder_config(cfg)
    if encoder and arch.endswith("ForSequenceClassification"):
        st = cfg.get("sentence_transformers") or {}
        activation = st.get("activation_fn") or cfg.get("sbert_ce_default_activation_function")
        labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1)
        default = DEFAULT_ACTIVATION if labels == 1 else "torch.nn.modules.linear.Identity"
        return PoolingSpec("score", folder, True, "cls", False, _tokenizer_max_len(folder), None,
                           activation or default)  # fmt: skip
    base_decoder = arch.endswith("Model") and not encoder
    if not (encoder or base_decoder or forced):
        return None
    # vLLM's defaults: CLS for an encoder, the last token for a decoder, normalized
    return PoolingSpec(
        "embed",
        folder,
        encoder,
        "cls" if encoder else "lasttoken",
        True,
        _tokenizer_max_len(folder),
        _matryoshka(cfg),
    )


def _matryoshka(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """config.json's Matryoshka declaration (vLLM's keys): matryoshka_dimensions, or is_matryoshka."""
    dims = cfg.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if cfg.get("is_matryoshka") else None


def _tokenizer_max_len(folder: Path) -> int | None:
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    n = _json(file).get("model_max_length")
    return int(n) if isinstance(n, (int, float)) and 0 < n < 1_000_000 else None


def _from_sentence_transformers(folder: Path) -> PoolingSpec:
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list) or not modules:
        raise InputError(f"{folder}/modules.json lists no modules", param="model")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [f"{k} ({m.get('path')})" for k, m in zip(kinds, modules) if k not in _KNOWN_MODULES]
    if unknown:
        raise InputError(
            f"{folder}: sentence-transformers module {unknown[0]} is not supported (only "
            f"{', '.join(_KNOWN_MODULES)})",
            param="model",
        )
    if kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
        raise InputError(f"{folder}: modules.json must start with its one Transformer module", "model")
    model_folder = folder / modules[0].get("path", "")
    pooling = [m for k, m in zip(kinds, modules) if k == "Pooling"]
    mode = _pooling_mode(folder / pooling[0].get("path", "")) if pooling else "cls"
    cfg = _json(model_folder / "config.json")
    prompt = _default_prompt(folder / "config_sentence_transformers.json")
    if (
        prompt
        and pooling
        and _json(folder / pooling[0].get("path", "") / "config.json").get("include_prompt") is False
    ):
        raise InputError(
            f"{folder}: a default prompt left out of pooling (include_prompt false) is not supported", "model"
        )
    st_config = folder / "sentence_bert_config.json"
    max_len = _json(st_config).get("max_seq_length") if st_config.is_file() else None
    return PoolingSpec(
        "embed",
        model_folder,
        is_encoder_config(cfg),
        mode,
        "Normalize" in kinds,
        int(max_len) if max_len else _tokenizer_max_len(model_folder),
        _matryoshka(cfg),
        prompt=prompt,
    )


def _default_prompt(file: Path) -> str:
    """The prompt sentence-transformers' encode puts before every text when it is given none: the one
    default_prompt_name names (e.g. an instruction of an instruction-tuned embedder), else none."""
    if not file.is_file():
        return ""
    cfg = _json(file)
    name = cfg.get("default_prompt_name")
    if name is None:
        return ""
    prompts = cfg.get("prompts") or {}
    if name not in prompts:
        raise InputError(f"{file}: default_prompt_name {name!r} is not among its prompts", param="model")
    return str(prompts[name])


def _pooling_mode(folder: Path) -> str:
    cfg = _json(folder / "config.json")
    mode = cfg.get("pooling_mode")
    if mode is None:
        on = [m for key, m in _LEGACY_MODES.items() if cfg.get(key)]
        mode = on if len(on) != 1 else on[0]
        mode = mode or "mean"  # sentence-transformers' default when no key is on
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in SUPPORTED_MODES:
        raise InputError(
            f"{folder}/config.json: pooling mode {mode!r} is not supported (one of {', '.join(SUPPORTED_MODES)})",
            param="model",
        )
    return mode
