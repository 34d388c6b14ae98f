"""method = "draft_model": a second, smaller model with the target's vocabulary guesses k tokens greedily.

The draft has its own paged KV cache (as many blocks as the target's, each holding the draft's K/V of
the same tokens) and its own block tables, kept here on mirror requests: one per target request, its
tokens the target's verified ones plus the drafts being proposed. Proposing runs the draft's own
ModelRunner k times: once over what the draft has not seen yet (the tokens verified since its last
proposal, all of them for a new request) ending in its first guess, then k - 1 one-token steps. A draft
whose guesses were rejected keeps its KV up to the last guess that held, so a steady request feeds it
one or two tokens a step. A target request that is preempted, aborted or finished drops its mirror.
"""

from __future__ import annotations

import torch

from pagedllm.config import CacheConfig, ModelConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import RunnerSync
from pagedllm.errors import InputError
from pagedllm.model.build import load_model_for_inference, resolve_quantization
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def resolve_draft_model(config: SpeculativeConfig):
    """(path, quantization) of the draft, checked before anything loads; errors name the field."""
    try:
        path = resolve_model_path(config.model)
        return path, resolve_quantization(path, config.quantization or "auto")
    except (InputError, OSError) as e:  # named for the field it came from, not the target's --model
        raise InputError(f"speculative_config.model: {e}", "speculative_config.model") from e


def load_draft_model(
    config: SpeculativeConfig, dtype: torch.dtype, target_tokenizer: Tokenizer, show_progress: bool
):
    """(model, its ModelConfig), checked to share the target's vocabulary token for token. Whole, in the
    engine's process, under tensor parallelism too: a draft is small, and its proposals are token ids."""
    path, quantization = resolve_draft_model(config)
    model, model_config = load_model_for_inference(path, dtype, quantization, show_progress=show_progress)
    draft_vocab = Tokenizer.from_checkpoint(path).hf.get_vocab()
    if draft_vocab != target_tokenizer.hf.get_vocab():
        raise InputError(
            f"speculative_config.model {config.model!r} has another vocabulary than the target "
            f"({len(draft_vocab)} tokens): a draft model must share the target's tokenizer",
            "speculative_config.model",
        )
    return model, model_config


class DraftModelProposer:
    def __init__(self, model, model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype):
        self.model_config = model_config
        self.kv = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, enable_prefix_caching=False
        )
        self.runner = ModelRunner(model, model_config, cache_config, dtype, max_decode_rows_chunk=8)
        self.sync = RunnerSync()  # what the draft's runner holds of each mirror
        self.mirrors: dict[str, Request] = {}  # request id -> the draft's view of that request
        self._base: dict[str, int] = {}  # rid -> the target's num_tokens when the mirror's drafts began

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            mirror = self.mirrors.pop(rid, None)
            self._base.pop(rid, None)
            if mirror is not None:
                self.kv.free(mirror)
                self.sync.finish(rid)

    def retain(self, request_ids) -> None:
        """Drop the mirrors of every request not in request_ids (the running ones): a finished, aborted or
        preempted request's draft KV goes back."""
        self.remove([rid for rid in self.mirrors if rid not in request_ids])

    def _sync(self, req: Request) -> Request:
        """The mirror of req with its tokens set to req's verified ones and its computed tokens cut back
        to the longest prefix the draft saw with the same tokens."""
        mirror = self.mirrors.get(req.request_id)
        if mirror is None:
            mirror = Request(req.request_id, req.prompt_token_ids, _GREEDY)
            self.mirrors[req.request_id] = mirror
            self._base[req.request_id] = req.num_tokens
        base = self._base[req.request_id]
        guessed = mirror.token_ids_slice(base, mirror.num_tokens)
        verified = req.token_ids_slice(base, req.num_tokens)
        same = 0
        while same < min(len(guessed), len(verified)) and guessed[same] == verified[same]:
            same += 1
        mirror.output_token_ids = list(req.output_token_ids)
        self.sync.forget(req.request_id)  # its tokens were replaced: the runner gets them whole
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, base + same, req.num_tokens - 1)
        self.kv.free_tail(mirror, mirror.num_computed_tokens)
        self._base[req.request_id] = req.num_tokens
        return mirror

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> dict[str, list[int]]:
        mirrors, want = [], {}
        for req in requests:
            mirror = self._sync(req)
            k = num_tokens[req.request_id]
            # the draft writes what it has not seen, then its guesses but the last
            if not self.kv.allocate_slots(mirror, mirror.num_tokens - mirror.num_computed_tokens + k - 1):
                self.remove([req.request_id])
                continue
            mirrors.append(mirror)
            want[mirror.request_id] = k
        drafts: dict[str, list[int]] = {m.request_id: [] for m in mirrors}
        active = mirrors
        while active:
            step = {m.request_id: m.num_tokens - m.num_computed_tokens for m in active}
            out = self.runner.execute_model(self.sync.build(active, step))
            for m in active:
                m.num_computed_tokens += step[m.request_id]
                token = out.sampled[m.request_id][0].token_id
                m.output_token_ids.append(token)
                drafts[m.request_id].append(token)
            active = [m for m in active if len(drafts[m.request_id]) < want[m.request_id]]
        # the last guess was never fed: the mirror has computed all but it, like a target request
        return drafts

    @property
    def max_len(self) -> int:
        """Positions the draft model has (its rotary table): no guess goes past them."""
        return self.model_config.max_position_embeddings
