"""Benchmark prompts: a JSONL/JSON file (ours or ShareGPT-style), one prompt a line, or random tokens."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from pagedllm.errors import InputError


@dataclass
class BenchPrompt:
    prompt: str | list[int]
    max_tokens: int


def load_dataset(
    path: str | Path, default_max_tokens: int = 128, num_prompts: int | None = None
) -> list[BenchPrompt]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"dataset {p} does not exist", param="dataset")
    text = p.read_text()
    items: list[BenchPrompt] = []
    if p.suffix == ".json":  # ShareGPT: [{"conversations": [{"from": "human", "value": ...}, ...]}]
        for row in json.loads(text):
            turns = row.get("conversations") or row.get("conversation") or []
            if turns:
                items.append(BenchPrompt(turns[0]["value"], default_max_tokens))
    elif p.suffix == ".jsonl":
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                items.append(BenchPrompt(row["prompt"], int(row.get("max_tokens", default_max_tokens))))
    else:
        items = [BenchPrompt(line, default_max_tokens) for line in text.splitlines() if line.strip()]
    if not items:
        raise InputError(f"dataset {p} holds no prompts", param="dataset")
    return items[:num_prompts] if num_prompts else items


def random_prompts(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchPrompt]:
    rng = random.Random(seed)
    return [
        BenchPrompt([rng.randrange(100, vocab_size) for _ in range(input_len)], output_len)
        for _ in range(num_prompts)
    ]


def prompt_token_ids(prompts: list[BenchPrompt], model_path: Path) -> list[list[int]]:
    """Our tokenizer's ids for each prompt (for a GGUF, its own vocabulary), so that a peer engine is
    handed the very same tokens as ours rather than re-tokenizing the text its own way."""
    from pagedllm.model.tokenizer import Tokenizer

    if all(isinstance(p.prompt, list) for p in prompts):
        return [list(p.prompt) for p in prompts]
    tok = Tokenizer.from_checkpoint(model_path)
    return [p.prompt if isinstance(p.prompt, list) else tok.encode(p.prompt) for p in prompts]
