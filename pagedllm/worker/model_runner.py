"""Turns the scheduler's decision into one flat batch, runs the model over the paged cache, samples.

Per step: input_ids and positions of every new token, the slot each token's K/V goes to
(slot_mapping), and for every sequence its block table and context length. Decodes are ordered
first so the attention backend can batch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.kv_quant import QuantizedKVCache, resolve_kv_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.errors import InputError
from pagedllm.worker import batch_invariant as batch_invariance
from pagedllm.worker import kv_transfer
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.prompt_logprobs import PromptLogprobs, PromptLogprobsSpan, compute_prompt_logprobs
from pagedllm.worker.rejection_sampler import greedy_verify, rejection_sample
from pagedllm.worker.sampler import SamplingBatch, greedy, is_plain_greedy, sample_requests


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token, when logprobs were asked for
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ModelRunnerOutput:
    # request id -> its tokens of this step (the requests that sampled): one, or a verified run of drafts
    sampled: dict[str, list[SampledToken]]
    prompt_logprobs: dict[str, PromptLogprobs]  # request id -> this step's part of its prompt logprobs
    # --kv-offload-dir: the bytes of scheduler_output.kv_blocks_to_save, in its order (worker/kv_transfer.py)
    kv_saved: list[bytes] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        dtype: torch.dtype,
        max_decode_rows_chunk: int = 0,
        samples: bool = True,
        batch_invariant: bool = False,
    ):
        """max_decode_rows_chunk: a chunk of 2..this many tokens after cached ones, its request's last, runs
        as decode rows (the draft model's catch-up of one or two tokens a step); 0 = never.
        samples: False on a tensor-parallel worker other than rank 0: it runs the forward and the logits
        (collectives every rank joins) and leaves sampling to rank 0.
        batch_invariant: --batch-invariant (ops.py, batch_invariant.py): every token of every step runs as a
        decode row, prompt chunks included, so a row's numbers never depend on how its request was batched
        or chunked; the model must have been built under ops.batch_invariant() (InputError naming what
        would still depend on the batch)."""
        self.model = model
        self.lora = None  # a lora.manager.LoRAModelManager when the engine serves adapters (executor/worker.py)
        self.batch_invariant = batch_invariant
        self.samples = samples
        self.input_batch = InputBatch()
        self.max_decode_rows_chunk = max_decode_rows_chunk
        self.config = model_config
        self.block_size = cache_config.block_size
        shape = (cache_config.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, dtype)
        if isinstance(kv_dtype, str):  # int8 / fp8 codes with per-token, per-head scales
            self.kv_caches = [
                QuantizedKVCache.zeros(kv_dtype, *shape) for _ in range(model_config.num_layers)
            ]
        else:
            # zeroed, not empty: padded decode positions read block 0, and NaN garbage leaks through 0 * NaN
            self.kv_caches = [
                torch.zeros((2, *shape), dtype=kv_dtype) for _ in range(model_config.num_layers)
            ]
        if batch_invariant:
            problem = batch_invariance.attention_problem(kv_dtype, dtype) or batch_invariance.model_problem(
                model
            )
            if problem is not None:
                raise InputError(f"batch_invariant cannot be kept with {problem}", batch_invariance.PARAM)

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its own copy of a shared block before it writes into it."""
        if not blocks_to_copy:
            return
        src = torch.tensor([s for s, _ in blocks_to_copy])
        dst = torch.tensor([d for _, d in blocks_to_copy])
        for cache in self.kv_caches:
            if isinstance(cache, QuantizedKVCache):
                cache.copy_blocks(src, dst)
            else:
                cache[:, dst] = cache[:, src]

    def prepare_inputs(
        self, requests: list, num_new: dict[str, int], spec: dict[str, list[int]] | None = None
    ):
        """The flat batch. A request verifying draft tokens (spec) feeds its last token and the drafts as
        that many decode rows over its one block table, row j seeing positions 0..start + j: each layer
        writes the whole step's K/V before attending, so the decode kernels (and the fused stack) attend a
        row to the drafts before it without a per-sequence path. Under batch_invariant every request's
        tokens are fed so, a prompt's chunk too: its row for position p is what a decode at p computes."""
        bs = self.block_size
        spec = spec or {}

        def as_decode_rows(req) -> bool:
            if req.request_id in spec or self.batch_invariant:
                return True
            n, start = num_new[req.request_id], req.num_computed_tokens
            return (
                1 < n <= self.max_decode_rows_chunk
                and start > 0
                and start + n == req.num_tokens
                and req.sampling_params.prompt_logprobs is None
            )

        rows_of = (
            {r.request_id for r in requests if as_decode_rows(r)}
            if spec or self.max_decode_rows_chunk or self.batch_invariant
            else ()
        )
        # decodes (one new token) and decode rows first: the attention backend attends them in one call
        order = sorted(requests, key=lambda r: num_new[r.request_id] != 1 and r.request_id not in rows_of)
        if self.lora is not None:  # each request's rows (num_new of them, in this order) to its adapter's slot
            self.lora.set_batch([(r.lora_int_id, num_new[r.request_id]) for r in order])
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[tuple[list[int], int]] = []  # each request's block table and its rows
        sample_rows: list[int] = []  # index into the flat batch of each sampling row's last token
        sampling_requests = []
        prompt_spans: list[PromptLogprobsSpan] = []
        num_decodes = 0

        def add_prompt_span(req, start: int, end: int) -> None:
            """The rows of tokens start..end-1 that predict prompt tokens, if the request asked for their
            logprobs (they begin at the next row of the flat batch)."""
            num_top = req.sampling_params.prompt_logprobs
            last = min(end, req.num_prompt_tokens - 1)  # rows before it predict prompt tokens
            if num_top is not None and start < last:
                prompt_spans.append(
                    PromptLogprobsSpan(req.request_id, query_start_loc[-1], last - start, start + 1, num_top)
                )

        for req in order:
            n, start = num_new[req.request_id], req.num_computed_tokens
            end = start + n
            table = req.block_ids
            if req.request_id in rows_of:
                drafts = spec.get(req.request_id)
                if drafts:  # the last known token, then the drafts: every row samples
                    input_ids.extend(req.tokens(start, start + 1))
                    input_ids.extend(drafts)
                    first_sampling = start
                else:  # a chunk: its last row samples if it reaches the last known token
                    input_ids.extend(req.tokens(start, end))
                    first_sampling = end - 1 if end == req.num_tokens else end
                    add_prompt_span(req, start, end)  # (batch_invariant: a prompt's chunk)
                for p in range(start, end):
                    if p >= first_sampling:
                        sample_rows.append(query_start_loc[-1])
                    positions.append(p)
                    slot_mapping.append(table[p // bs] * bs + p % bs)
                    query_start_loc.append(query_start_loc[-1] + 1)
                    seq_lens.append(p + 1)
                tables.append((table, n))
                num_decodes += n
                if first_sampling < end:
                    sampling_requests.append(req)
                continue
            add_prompt_span(req, start, end)
            input_ids.extend(req.tokens(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            tables.append((table, 1))
            num_decodes += n == 1
            if end == req.num_tokens:  # caught up with every known token: this row samples the next one
                sample_rows.append(query_start_loc[-1] - 1)
                sampling_requests.append(req)
        # padded with block 0; filled in numpy (a third of torch.tensor's time on nested lists), a request's
        # decode rows (its table repeated) in one assignment
        block_tables = np.zeros((len(seq_lens), max(len(t) for t, _ in tables)), dtype=np.int64)
        row = 0
        for table, repeat in tables:
            block_tables[row : row + repeat, : len(table)] = table
            row += repeat
        # entries freed out of a sliding window (NULL_BLOCK_ID, -1) read as block 0: no query attends there
        np.maximum(block_tables, 0, out=block_tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=torch.from_numpy(block_tables),
            num_decodes=num_decodes,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long),
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        return ids, pos, meta, sample_rows, sampling_requests, prompt_spans

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output, grammar_bitmask: tuple[list[str], torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """One step. First the disk's blocks (--kv-offload-dir): evicted blocks are copied out before
        anything (a load, a copy-on-write, the forward) overwrites them, then blocks read back are filled."""
        kv_saved = kv_transfer.save_blocks(self.kv_caches, [b for b, _ in scheduler_output.kv_blocks_to_save])
        kv_transfer.load_blocks(self.kv_caches, scheduler_output.kv_blocks_to_load)
        out = self._execute_model(scheduler_output, grammar_bitmask)
        out.kv_saved = kv_saved
        return out

    @torch.inference_mode()
    def _execute_model(
        self, scheduler_output, grammar_bitmask: tuple[list[str], torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """grammar_bitmask: (request ids, their token bitmasks) for the requests whose next token a grammar
        constrains (structured outputs): one row each, or for a request verifying k drafts k + 1 rows in
        a row (one per position, the matcher advanced over the drafts before it)."""
        requests = self.input_batch.update(scheduler_output)
        self.copy_blocks(scheduler_output.blocks_to_copy)
        if not requests:
            return ModelRunnerOutput({}, {})
        spec = scheduler_output.scheduled_spec_decode_tokens
        ids, pos, meta, sample_rows, sampling_requests, prompt_spans = self.prepare_inputs(
            requests, scheduler_output.num_scheduled_tokens, spec
        )
        hidden = self.model(ids, pos, self.kv_caches, meta)
        prompt_logprobs = {}
        if prompt_spans:
            prompts = {r.request_id: r.prompt_token_ids for r in requests}
            prompt_logprobs = compute_prompt_logprobs(self.model, hidden, prompt_spans, prompts)
        if not sampling_requests:
            return ModelRunnerOutput({}, prompt_logprobs)
        if len(sample_rows) < hidden.shape[0]:  # a pure decode step samples every row, in order
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden, upcast=False)
        if not self.samples:
            return ModelRunnerOutput({}, {})
        if spec:
            return ModelRunnerOutput(
                self._verify(logits, sampling_requests, spec, grammar_bitmask), prompt_logprobs
            )
        token_bitmask = None
        if grammar_bitmask is not None:
            mask_row = {rid: i for i, rid in enumerate(grammar_bitmask[0])}
            rows = [i for i, r in enumerate(sampling_requests) if r.request_id in mask_row]
            masks = grammar_bitmask[1][[mask_row[sampling_requests[i].request_id] for i in rows]]
            token_bitmask = (rows, masks) if rows else None
        out = sample_requests(logits, sampling_requests, token_bitmask)
        result = {}
        for i, req in enumerate(sampling_requests):
            result[req.request_id] = [
                SampledToken(
                    token_id=out.token_ids[i],
                    logprob=out.sampled_logprobs[i],
                    rank=out.sampled_ranks[i] if out.sampled_ranks else None,
                    top_logprobs=out.logprobs[i],
                )
            ]
        return ModelRunnerOutput(result, prompt_logprobs)

    def _verify(
        self,
        logits: torch.Tensor,
        requests: list,
        spec: dict[str, list[int]],
        grammar_bitmask: tuple[list[str], torch.Tensor] | None,
    ) -> dict[str, list[SampledToken]]:
        """Rejection-sample a step where some requests verify drafts: one sampling row per position, each
        seeing the request's output extended by the drafts before it."""
        spans, first = [], 0
        for req in requests:
            drafts = spec.get(req.request_id, [])
            spans.append((first, drafts))
            first += len(drafts) + 1
        # row 0 has the fewest output tokens: if it is past min_tokens, every row is
        if grammar_bitmask is None and all(
            is_plain_greedy(r.sampling_params, r.num_output_tokens) for r in requests
        ):
            runs = greedy_verify(greedy(logits).tolist(), spans)  # the argmax of every row, no SamplingBatch
        else:
            runs = self._rejection_sample(logits, requests, spans, spec, grammar_bitmask)
        return {
            req.request_id: [
                SampledToken(t, run.sampled_logprobs[i], run.sampled_ranks[i], run.logprobs[i])
                for i, t in enumerate(run.token_ids)
            ]
            for req, run in zip(requests, runs)
        }

    def _rejection_sample(self, logits, requests, spans, spec, grammar_bitmask) -> list:
        rows = []
        for req, (_, drafts) in zip(requests, spans):
            out_ids = req.output_token_ids
            for j in range(len(drafts) + 1):
                history = out_ids + drafts[:j] if j else out_ids
                rows.append(
                    (req.sampling_params, req.prompt_token_ids, history, req.generator, req.eos_token_ids)
                )
        token_bitmask = None
        if grammar_bitmask is not None:
            first_mask = {}
            at = 0
            for rid in grammar_bitmask[0]:
                first_mask[rid] = at
                at += len(spec.get(rid, ())) + 1
            mask_rows, masks = [], []
            for req, (first, drafts) in zip(requests, spans):
                if req.request_id in first_mask:
                    mask_rows.extend(range(first, first + len(drafts) + 1))
                    masks.extend(
                        range(first_mask[req.request_id], first_mask[req.request_id] + len(drafts) + 1)
                    )
            if mask_rows:
                token_bitmask = (mask_rows, grammar_bitmask[1][masks])
        batch = SamplingBatch.from_rows(rows, logits.shape[-1], token_bitmask=token_bitmask)
        return rejection_sample(logits, batch, spans, [r.generator for r in requests])
