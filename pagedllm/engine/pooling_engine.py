"""The pooling engine: embeddings and cross-encoder scores, beside the generative LLMEngine.

A pooling request is whole inputs in, one vector (or score) per input out, in one forward: nothing is
generated, so there is no KV cache to keep, no blocks, no steps. The scheduling that remains is the
token budget: inputs are sorted by length and cut into forwards of at most `max_num_batched_tokens`
tokens (and `max_num_seqs` inputs), so that many short inputs share one forward and inputs of similar
lengths share attention's padded block (model/encoder.py). vLLM's pooling runner does the same with its
scheduler; with no KV cache to share, a plain loop over the budget is all of it here.

Tokenization lives here too (the server and LLM.embed / LLM.score call it): the model's own tokenizer,
called as sentence-transformers calls it (its special tokens; a pair as one input with token type ids).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.engine.llm_engine import resolve_dtype
from pagedllm.errors import InputError
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.loader.sentence_transformers import PoolingSpec, pooling_spec
from pagedllm.model.pooling_model import PoolingModel
from pagedllm.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolingInput:
    """One input: its token ids, and for a cross-encoder's (query, document) pair its token type ids."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class PoolingModelConfig:
    """What the server reads of a model's shape (EngineClient.model_config): vocab_size to check token ids."""

    vocab_size: int
    hidden_size: int
    architecture: str


def is_pooling_model(model: str, runner: str = "auto") -> bool:
    """Whether `model` (a path or "default") is served by this engine (model/loader/sentence_transformers.py
    decides from the folder; runner "pooling" forces a decoder, "generate" never)."""
    if model == "default" and runner != "pooling":
        return False
    try:
        path = resolve_model_path(model)
    except InputError:
        if runner == "pooling":
            raise
        return False  # the generative engine checks its options first, then names the missing path
    return pooling_spec(path, runner) is not None


class PoolingEngine:
    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype | None = "auto",
        runner: str = "auto",
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
    ):
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            if value is not None and value < 1:
                raise InputError(f"{name} must be at least 1, got {value}", param=name)
        path = resolve_model_path(model)
        spec = pooling_spec(Path(path), runner)
        if spec is None:
            raise InputError(
                f"{model} is a generative model, not an embedding or scoring model "
                "(pass --runner pooling to pool a decoder's hidden states)",
                param="model",
            )
        self.spec: PoolingSpec = spec
        self.dtype = resolve_dtype(dtype)
        ops.table()  # every kernel the model will call, built before the first request (as LLMEngine does)
        self.model = PoolingModel(spec, self.dtype)
        self.tokenizer = Tokenizer.from_checkpoint(spec.model_folder)
        self._tokenizer_lock = threading.Lock()
        limit = self.model.max_model_len
        if max_model_len is not None and max_model_len > limit:
            raise InputError(f"max_model_len {max_model_len} is above the model's {limit}", "max_model_len")
        self.max_model_len = max_model_len or limit
        # a forward must take the longest input whole
        self.max_num_batched_tokens = max(max_num_batched_tokens, self.max_model_len)
        self.max_num_seqs = max_num_seqs
        self.model_config = PoolingModelConfig(
            self.model.vocab_size, self.model.hidden_size, "encoder" if spec.encoder else "decoder"
        )
        logger.info(
            "pooling model %s: task %s, %s pooling%s, max_model_len %d, %s",
            model,
            spec.task,
            spec.pooling_type,
            ", normalized" if spec.normalize else "",
            self.max_model_len,
            self.dtype,
        )

    @property
    def task(self) -> str:
        """ "embed" or "score" (a cross-encoder)."""
        return self.spec.task

    # ---- tokenization (the server's and LLM's)

    def tokenize(
        self,
        text: str | tuple[str, str],
        truncate: int | None = None,
        param: str = "input",
    ) -> PoolingInput:
        """A text, or a (query, document) pair, as the model's tokenizer encodes it; `truncate` keeps at
        most that many tokens (its special tokens included); without it an input over max_model_len is an
        InputError naming `param`."""
        limit = self.max_model_len if truncate is None else min(truncate, self.max_model_len)
        # sentence-transformers' default prompt goes before a text it embeds (not before a scored pair)
        pair = (self.spec.prompt + text,) if isinstance(text, str) else tuple(text)
        cut = {"truncation": True, "max_length": limit} if truncate is not None else {}
        with self._tokenizer_lock:  # a call with truncation sets the fast tokenizer's state for the next
            enc = self.tokenizer.hf(*pair, **cut)
        types = enc.get("token_type_ids") if len(pair) == 2 else None
        return self.check(PoolingInput(list(enc["input_ids"]), list(types) if types else None), None, param)

    def check(self, item: PoolingInput, truncate: int | None, param: str = "input") -> PoolingInput:
        """Token ids given as they are: cut to the last `truncate` (vLLM's rule for token input), then
        checked against the vocabulary and max_model_len."""
        ids = item.token_ids
        if truncate is not None:
            ids = ids[-truncate:] if truncate < len(ids) else ids
            item = PoolingInput(ids, item.token_type_ids[-len(ids) :] if item.token_type_ids else None)
        if not ids:
            raise InputError(f"{param} holds an empty input (no tokens)", param=param)
        if len(ids) > self.max_model_len:
            raise InputError(
                f"{param} has an input of {len(ids)} tokens, over this model's maximum of {self.max_model_len}; "
                "shorten it or set truncate_prompt_tokens",
                param=param,
            )
        bad = next((t for t in ids if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise InputError(
                f"{param}: token id {bad} is outside the vocabulary [0, {self.model.vocab_size})", param
            )
        return item

    # ---- the forwards

    def batches(self, items: list[PoolingInput]) -> list[list[int]]:
        """Indices of `items` grouped into forwards: sorted by length, each under the token budget."""
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids))
        out: list[list[int]] = []
        tokens = 0
        for i in order:
            n = len(items[i].token_ids)
            if out and tokens + n <= self.max_num_batched_tokens and len(out[-1]) < self.max_num_seqs:
                out[-1].append(i)
                tokens += n
            else:
                out.append([i])
                tokens = n
        return out

    def embed(self, items: list[PoolingInput]) -> torch.Tensor:
        """[N, hidden] float32: each input's pooled vector (normalized where the model normalizes)."""
        return self._run(items, lambda batch: self.model.embed([b.token_ids for b in batch]))

    def score(self, items: list[PoolingInput]) -> torch.Tensor:
        """[N, num_labels] float32: each (query, document) input's score, as CrossEncoder.predict gives it."""
        return self._run(
            items,
            lambda batch: self.model.score([b.token_ids for b in batch], [b.token_type_ids for b in batch]),
        )

    def score_pairs(
        self, pairs: list[tuple[str, str]], truncate: int | None = None, param: str = "text_2"
    ) -> tuple[torch.Tensor, int]:
        """One score per (query, document) pair, and the tokens read: a cross-encoder's score of the pair
        (one label), or an embedding model's cosine similarity of the two embeddings (as vLLM's)."""
        if self.task == "score":
            items = [self.tokenize(p, truncate, param) for p in pairs]
            out = self.score(items)
            if out.shape[1] != 1:
                raise InputError(f"the model has {out.shape[1]} labels; scoring needs one", param="model")
            return out[:, 0], sum(len(i.token_ids) for i in items)
        firsts = list(dict.fromkeys(a for a, _ in pairs))  # a query scored against many documents: once
        items = [self.tokenize(t, truncate, param) for t in [*firsts, *(b for _, b in pairs)]]
        vectors = self.embed(items)
        row = {t: i for i, t in enumerate(firsts)}
        left, right = vectors[[row[a] for a, _ in pairs]], vectors[len(firsts) :]
        return F.cosine_similarity(left, right, dim=-1), sum(len(i.token_ids) for i in items)

    def _run(self, items: list[PoolingInput], forward) -> torch.Tensor:
        results: list[torch.Tensor | None] = [None] * len(items)
        for group in self.batches(items):
            out = forward([items[i] for i in group])
            for i, row in zip(group, out):
                results[i] = row
        return torch.stack(results) if results else torch.empty(0)
