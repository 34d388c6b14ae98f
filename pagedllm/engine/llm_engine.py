"""LLMEngine: add requests, step them together, read their outputs.

One step: the scheduler picks who runs and where their K/V go, the model runner runs one flat batch
and samples, the scheduler advances the requests, the detokenizer turns new tokens into text and
checks stop strings. Requests with n > 1 are run as n sibling requests that share the prompt's blocks.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pagedllm import ops, planner, platform
from pagedllm.attention.kv_quant import KV_QUANT_DTYPES, kv_cache_bytes_per_token, resolve_kv_cache_dtype
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import check_scheduling_policy
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.partition import head_shards
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.kv_offload import KVOffloadEngineStats, KVOffloader, check_kv_offload_options, open_store
from pagedllm.engine.kv_view import KVCacheView
from pagedllm.errors import InputError
from pagedllm.executor import Executor, make_executor
from pagedllm.executor.worker import WorkerConfig
from pagedllm.lora.request import LoRARequest, LoRAStats, check_lora_options
from pagedllm.model.build import resolve_quantization
from pagedllm.model.loader import read_model_config, resolve_model_path
from pagedllm.model.tensor_parallel import check_shardable
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.spec_decode import SpecDecodingStats
from pagedllm.spec_decode.budget import AcceptanceTracker, StepCost, allot_drafts
from pagedllm.spec_decode.draft_model import DraftModelProposer, load_draft_model, resolve_draft_model
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.units import format_size, parse_size
from pagedllm.worker import batch_invariant as batch_invariance

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
TORCH_TO_PLANNER = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DEFAULT_KV_CACHE_MEMORY = "1GiB"


def default_dtype() -> torch.dtype:
    """bf16 where the CPU tier multiplies it natively (avx512_bf16, amx: about 4x fp32 GEMM), else fp32:
    below that tier bf16 is widened to fp32 for every product, slower than fp32 and less exact."""
    return torch.bfloat16 if platform.capabilities().native_bf16 else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return default_dtype()
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}", param="dtype")
    return DTYPES[dtype]


def _largest_rank_kv_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """cfg with the KV heads of the rank that holds the most: every rank gets as many blocks, so that rank
    decides how many fit the (per-rank) budget. head_shards refuses a split that cannot be made."""
    shards = head_shards(cfg.num_heads, cfg.num_kv_heads, tp_size)
    return replace(cfg, num_kv_heads=max(s.num_kv_heads for s in shards))


def _num_kv_blocks(
    num_kv_blocks: int | None, kv_cache_memory: str | int | None, block_size: int, per_tokens: list[int]
) -> int:
    """num_kv_blocks as given, else as many blocks as kv_cache_memory holds, a block costing every model's
    bytes a token in per_tokens (the target's, and a draft model's beside it)."""
    if num_kv_blocks is None:
        memory = parse_size(
            kv_cache_memory if kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY,
            param="kv_cache_memory",
        )
        num_kv_blocks = planner.num_blocks_for(memory, block_size, per_tokens)
    if num_kv_blocks < 1:
        raise InputError(
            "KV cache holds no block: raise kv_cache_memory or num_kv_blocks", param="num_kv_blocks"
        )
    return num_kv_blocks


def _context_length(max_model_len: int | None, max_positions: int, kv_tokens: int) -> int:
    """max_model_len (the model's positions when None) within the model's positions and the KV cache: a
    request may never need more blocks than the pool has, so the context shrinks to fit."""
    length = min(max_model_len or max_positions, max_positions)
    if kv_tokens < length:
        logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", length, kv_tokens)
        return kv_tokens
    return length


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_free_blocks: int
    num_cached_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: SpecDecodingStats | None = None  # None when speculation is off
    lora: LoRAStats | None = None  # None without enable_lora
    kv_offload: KVOffloadEngineStats | None = None  # None without --kv-offload-dir

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks_total - self.num_free_blocks


@dataclass
class _Group:
    """One user request: its n sibling Requests and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, Logprob]] | None]
    cumulative_logprob: list[float | None]
    metrics: RequestMetrics
    stop_reasons: list[str | int | None] = field(default_factory=list)
    # prompt_logprobs asked for: [None] (the first token) then one dict per prompt token computed so far
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLMEngine:
    def __init__(
        self,
        model: str = "default",
        dtype: str | torch.dtype | None = "auto",
        block_size: int = 16,
        kv_cache_memory: str | int | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        quantization: str | None = "auto",
        seed: int = 0,
        show_progress: bool = True,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        tensor_parallel_size: int = 1,
        batch_invariant: bool = False,
        scheduling_policy: str = "fcfs",
        kv_offload_dir: str | None = None,
        kv_offload_max_bytes: int | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ):
        """tensor_parallel_size: the model split over that many worker processes on this machine
        (executor/multiproc.py; gloo); 1 runs it in this process. Either way this process reads only the
        model's config and sizes the KV cache from it; the executor loads the weights (make_executor).
        batch_invariant: a request's greedy tokens (its logits, bit for bit) do not depend on what else runs
        in its steps (ops.py's BATCH_INVARIANT, worker/batch_invariant.py); what the mode cannot make
        invariant (tensor parallelism, dense linears, a quantized KV cache) is refused, naming it."""
        # check every option before the (slow) model load, so a typo fails at once
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("num_kv_blocks", num_kv_blocks),
            ("max_model_len", max_model_len),
            ("tensor_parallel_size", tensor_parallel_size),
        ):
            if value is not None and value < 1:
                raise InputError(f"{name} must be at least 1, got {value}", param=name)
        check_scheduling_policy(scheduling_policy)
        # LoRA adapters (pagedllm/lora): add_request(lora_request=...) names one; add_lora registers one
        self.lora_config = check_lora_options(
            enable_lora,
            max_loras,
            max_lora_rank,
            max_cpu_loras,
            tensor_parallel_size=tensor_parallel_size,
            speculative=speculative_config is not None,
            batch_invariant=batch_invariant,
        )
        # --kv-offload-dir: the prefix cache's blocks outlive the process (engine/kv_offload.py)
        spec_method = SpeculativeConfig.parse(speculative_config)
        offload_max_bytes = check_kv_offload_options(
            kv_offload_dir,
            kv_offload_max_bytes,
            enable_prefix_caching,
            tensor_parallel_size,
            spec_method.method if spec_method is not None else None,
        )
        self.dtype = resolve_dtype(dtype)
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        if kv_cache_memory is not None:
            parse_size(kv_cache_memory, param="kv_cache_memory")
        self.speculative_config = spec = SpeculativeConfig.parse(speculative_config)
        if spec is not None and spec.method == "draft_model":
            resolve_draft_model(spec)
        torch.manual_seed(seed)
        self.model_path = path = resolve_model_path(model)
        ops.table()  # every kernel this machine's op table picks is built now, never inside a request
        self.quantization = resolve_quantization(path, quantization)
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            problem = batch_invariance.engine_problem(
                tensor_parallel_size, self.quantization, kv_dtype, self.dtype
            )
            if problem is not None:
                raise InputError(f"batch_invariant cannot be kept with {problem}", batch_invariance.PARAM)
        self.tensor_parallel_size = tensor_parallel_size
        self.model_config = cfg = read_model_config(path)
        kv_cfg = _largest_rank_kv_config(cfg, tensor_parallel_size)  # refuses a split that cannot be made
        check_shardable(cfg, tensor_parallel_size)  # and what model/tensor_parallel.py cannot split
        self.tokenizer = Tokenizer.from_checkpoint(path)
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(spec, self.dtype, self.tokenizer, show_progress)

        self.kv_bytes_per_token = self._kv_bytes_per_token(kv_cfg, kv_dtype)
        # a draft model's KV sits beside the target's, block for block: each block costs both (under
        # tensor parallelism the draft's is in this process, and each rank's budget still counts it)
        per_tokens = [self.kv_bytes_per_token]
        if draft is not None:
            per_tokens.append(self._kv_bytes_per_token(draft[1], kv_dtype))
        self.kv_block_bytes = planner.block_bytes(block_size, sum(per_tokens))
        num_kv_blocks = _num_kv_blocks(num_kv_blocks, kv_cache_memory, block_size, per_tokens)
        self.max_model_len = _context_length(
            max_model_len, cfg.max_position_embeddings, num_kv_blocks * block_size
        )
        # every layer windowed: a request's blocks before its window go back to the pool as it moves on
        window = cfg.sliding_window if cfg.all_layers_sliding else None
        self.cache_config = CacheConfig(
            block_size, num_kv_blocks, kv_cache_dtype, enable_prefix_caching, window
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, self.max_model_len, scheduling_policy
        )
        self.kv_offloader: KVOffloader | None = None
        if kv_offload_dir is not None:
            store = open_store(
                kv_offload_dir,
                offload_max_bytes,
                path,
                quantization=self.quantization,
                dtype=str(self.dtype),
                kv_dtype=str(kv_dtype),
                block_size=block_size,
                num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                batch_invariant=self.batch_invariant,
                block_bytes=self.kv_bytes_per_token * block_size,
            )
            self.kv_offloader = KVOffloader(store)
            self.kv_offloader.register_atexit(self)
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.cache_config,
            self.kv_offloader.store if self.kv_offloader is not None else None,
        )
        self.executor: Executor = make_executor(
            WorkerConfig(
                str(path),
                self.dtype,
                self.quantization,
                self.cache_config,
                tensor_parallel_size,
                seed,
                batch_invariant=self.batch_invariant,
                lora_config=self.lora_config,
            ),
            show_progress,
        )
        if self.lora_config is not None:
            self.scheduler.max_loras = self.lora_config.max_loras
        self._start_speculation(draft)
        tokens = num_kv_blocks * block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s); max concurrency at %d tokens: %.2f x",
            num_kv_blocks,
            block_size,
            tokens,
            format_size(num_kv_blocks * self.kv_block_bytes),
            self.max_model_len,
            tokens / self.max_model_len,
        )
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | {self.tokenizer.eos_token_id} - {None})
        self.structured_output = StructuredOutputManager(
            self.tokenizer.hf, cfg.vocab_size, self.eos_token_ids
        )
        self._pending_grammars: dict[str, Request] = {}  # child id -> request whose grammar still compiles
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, _Group] = {}
        self.kv_view: KVCacheView | None = None  # only while someone watches (open_kv_view)

    def _start_speculation(self, draft: tuple | None) -> None:
        """The proposer (on this process's token ids, or the draft model loaded here), its counters, and
        the step cost the draft budget weighs rows by: measured through the executor (every rank's step
        under tensor parallelism) before any request, or free rows under draft_budget "off"."""
        spec = self.speculative_config
        self.proposer: NgramProposer | DraftModelProposer | None = None
        self.spec_decoding_stats: SpecDecodingStats | None = None
        if spec is None:
            return
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.proposer = DraftModelProposer(*draft, self.cache_config, self.dtype)
        self.spec_decoding_stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens
        )
        self._acceptance = AcceptanceTracker()
        if spec.draft_budget == "off":  # rows are free: every proposal is verified
            self.step_cost = StepCost.linear(fixed=1.0, per_row=0.0)
        else:
            self.step_cost = StepCost.measure(self.executor, self.scheduler.kv_cache_manager)
        self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner when it runs in this process (tensor_parallel_size 1), else None: for tests and
        profiling scripts; the engine itself only talks to self.executor."""
        return getattr(self.executor, "runner", None)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model when it runs in this process, else None (tensor parallelism: the workers hold it)."""
        runner = self.runner
        return None if runner is None else runner.model

    @staticmethod
    def _kv_bytes_per_token(cfg, kv_dtype) -> int:
        if kv_dtype in KV_QUANT_DTYPES:  # codes plus their per-token, per-head scales
            return kv_cache_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        return planner.kv_bytes_per_token(cfg.num_layers, cfg.kv_width, TORCH_TO_PLANNER[kv_dtype])

    # ---- requests in ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """priority: lower runs first under scheduling_policy "priority"; fcfs takes only 0 (vLLM's rule).
        lora_request: the adapter to run it with (registered here on first use; enable_lora engines only)."""
        params = params or SamplingParams()
        lora_int_id = self.add_lora(lora_request) if lora_request is not None else 0
        if type(priority) is not int:
            raise InputError(f"priority must be an integer, got {priority!r}", param="priority")
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise InputError(
                f"priority {priority} needs priority scheduling (--scheduling-policy priority); "
                f"this engine schedules {self.scheduler_config.policy}",
                param="priority",
            )
        if request_id in self._groups:
            raise InputError(f"request_id {request_id!r} is already running", param="request_id")
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, list(prompt)
        if not prompt_ids:
            raise InputError("prompt is empty: it must have at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InputError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        params.check_vocab(vocab)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise InputError(
                    f"prompt has {len(prompt_ids)} tokens, the context length is {self.max_model_len}",
                    param="prompt",
                )
        self.scheduler.check_can_ever_fit(len(prompt_ids), max_tokens)
        structured = params.structured_outputs

        now = arrival_time if arrival_time is not None else time.time()
        group = _Group(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=prompt_ids,
            params=params,
            children=[],
            detokenizers=[],
            logprobs=[],
            cumulative_logprob=[],
            metrics=RequestMetrics(arrival_time=now),
            stop_reasons=[None] * params.n,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=child_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=now,
                priority=priority,
                lora_int_id=lora_int_id,
                group_id=request_id,
                index=i,
                seed=None if params.seed is None else (params.seed + i) % 2**64,  # a uint64 seed
            )
            if structured is not None:
                # validates: a malformed constraint raises here, for child 0, before any state is kept
                req.structured_output = self.structured_output.request(structured)
                self._pending_grammars[child_id] = req
            group.children.append(req)
            group.detokenizers.append(
                IncrementalDetokenizer(
                    self.tokenizer.hf,
                    prompt_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            )
            group.logprobs.append([] if params.logprobs is not None else None)
            group.cumulative_logprob.append(0.0 if params.logprobs is not None else None)
            self._child_to_group[child_id] = group
        self._groups[request_id] = group
        for req in group.children:
            self.scheduler.add_request(req)

    # ---- LoRA adapters ----------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> int:
        """Register an adapter (its folder read and checked now: InputError naming what is wrong); returns
        its lora_int_id. Registering it again is a no-op."""
        if self.lora_config is None:
            raise InputError("LoRA adapters need an engine built with enable_lora=True", param="lora_request")
        manager = self.runner.lora
        if manager.registered.get(lora_request.lora_int_id) != lora_request:
            manager.add_adapter(lora_request)
        return lora_request.lora_int_id

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it); False if it was not registered."""
        return self.lora_config is not None and self.runner.lora.remove_adapter(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora_config is None else list(self.runner.lora.registered.values())

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            ids = [c.request_id for c in group.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for cid in ids:
                self._child_to_group.pop(cid, None)
                self._pending_grammars.pop(cid, None)
            if self.proposer is not None:
                self.proposer.remove(ids)

    def warm_up(self) -> None:
        """One short prompt through both kinds of step (a prefill, then a decode), so that the first real
        request does not pay for what a first call sets up (oneDNN primitives, thread pools, lazily built
        layouts). Its blocks and prefix-cache statistics are given back. The server calls it before
        /health says 200."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() runs before any request")
        prompt = [self.eos_token_ids[0] if self.eos_token_ids else 0] * min(16, self.max_model_len - 2)
        self.add_request("__warm_up__", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        manager = self.scheduler.kv_cache_manager
        manager.block_pool.reset_prefix_cache()
        manager.prefix_cache_stats = type(manager.prefix_cache_stats)()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._check_grammars()
        if self.proposer is not None:
            self._propose()
        sched_out = self.scheduler.schedule()
        if self.kv_view is not None:
            self.kv_view.on_schedule(sched_out)
        if sched_out.is_empty and self._pending_grammars:
            # nothing to run but grammars being compiled: wait for one instead of spinning
            wait([r.structured_output.future for r in self._pending_grammars.values()], 0.05, FIRST_COMPLETED)
        now = time.time()
        for rid in sched_out.num_scheduled_tokens:
            group = self._child_to_group.get(rid)
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        runner_out = self.executor.execute_model(sched_out, self._grammar_bitmask(sched_out))
        if self.kv_offloader is not None:
            self.kv_offloader.after_step(sched_out, runner_out)
        sampled = runner_out.sampled
        for rid, part in runner_out.prompt_logprobs.items():
            self._add_prompt_logprobs(rid, part)
        if self.spec_decoding_stats is not None:
            for rid, drafts in sched_out.scheduled_spec_decode_tokens.items():
                if rid in sampled:
                    self.spec_decoding_stats.observe(len(drafts), len(sampled[rid]) - 1)
                    self._acceptance.observe(rid, len(drafts), len(sampled[rid]) - 1)
        # the scheduler keeps each run's tokens up to a stop (EOS, stop token, max_tokens) and cuts `kept`
        kept = {rid: [s.token_id for s in run] for rid, run in sampled.items()}
        self.scheduler.update_from_output(sched_out, kept)
        now = time.time()
        touched: dict[str, _Group] = {g.request_id: g for g in failed}
        for rid, run in sampled.items():
            group = self._child_to_group.get(rid)
            if group is None:
                continue
            touched[group.request_id] = group
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            i = int(rid.rsplit("#", 1)[1]) if group.params.n > 1 else 0
            self._take_tokens(group, i, run[: len(kept[rid])])
        if self.proposer is not None:
            running = {r.request_id for r in self.scheduler.running}
            self.proposer.retain(running)  # a finished or preempted request's draft state goes now
            self._acceptance.retain(self.scheduler.requests)
        outputs = []
        for group in touched.values():
            finished = all(c.is_finished for c in group.children)
            if finished:
                group.metrics.finished_time = now
                group.metrics.num_preemptions = sum(c.num_preemptions for c in group.children)
                del self._groups[group.request_id]
                for c in group.children:
                    self._child_to_group.pop(c.request_id, None)
            elif group.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue  # nobody reads it: 32 outputs a step cost a W32 decode step ~0.3 ms
            outputs.append(self._make_output(group, finished))
        return outputs

    def _take_tokens(self, group: _Group, i: int, run: list) -> None:
        """Child i's tokens of this step, one by one: logprobs, text, stop strings, grammar. A stop string
        or the grammar's end inside a verified run finishes the request there: the run's later tokens are
        taken back out of its output."""
        req = group.children[i]
        for n, s in enumerate(run, start=1):
            # a request the scheduler finished (EOS, max_tokens) finished at the run's last token
            live = not req.is_finished or n < len(run)
            if group.logprobs[i] is not None:
                group.logprobs[i].append(self._logprob_dict(s))
                group.cumulative_logprob[i] += s.logprob
            stop = group.detokenizers[i].update([s.token_id])
            grammar = req.structured_output
            if grammar is not None and live and not grammar.accept_token(s.token_id):
                logger.warning(
                    "request %s: token %d is outside its grammar: %s",
                    req.request_id,
                    s.token_id,
                    grammar.error,
                )
            ended = False
            if stop is not None and live:
                group.stop_reasons[i] = stop
                ended = True
            elif grammar is not None and grammar.is_terminated and live:
                ended = (
                    True  # the grammar ended (its text is complete): stop as at EOS, even under ignore_eos
                )
            elif req.is_finished and req.stop_reason is not None:
                group.stop_reasons[i] = req.stop_reason
            if ended:
                if n < len(run):
                    del req.output_token_ids[n - len(run) :]
                if req.is_finished:  # by a stop the scheduler saw later in the run: this one came first
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                else:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                return

    def _propose(self) -> None:
        """Draft tokens for every running request that has caught up with its tokens (decoding), as many
        as its max_tokens and the context leave room for; set on request.spec_token_ids for the scheduler."""
        spec = self.speculative_config
        limit = (
            self.max_model_len
            if self.proposer.max_len is None
            else min(self.max_model_len, self.proposer.max_len)
        )
        wants: dict[str, int] = {}
        decoding = []
        for req in self.scheduler.running:
            if req.num_computed_tokens != req.num_tokens - 1 or req.is_finished:
                continue
            if req.structured_output is not None and req.structured_output.matcher is None:
                continue
            k = spec.num_speculative_tokens
            max_tokens = req.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - req.num_output_tokens - 1)
            k = min(k, limit - req.num_tokens)
            if k > 0:
                wants[req.request_id] = k
                decoding.append(req)
        # only the drafts whose expected tokens pay for their rows (spec_decode/budget.py)
        rates = {rid: self._acceptance.rate(rid) for rid in wants}
        wants = allot_drafts(rates, wants, len(self.scheduler.running), self.step_cost)
        decoding = [r for r in decoding if wants[r.request_id] > 0]
        if not decoding:
            return
        proposals = self.proposer.propose(decoding, wants)
        for req in decoding:
            drafts = proposals.get(req.request_id, [])[: wants[req.request_id]]
            if drafts and req.structured_output is not None:
                drafts = self.structured_output.validate_drafts(req, drafts)
            req.spec_token_ids = drafts

    def _check_grammars(self) -> list[_Group]:
        """Drop compiled grammars from the pending set; a request whose grammar failed to compile is
        aborted (its group is returned, to report it) while every other request goes on."""
        failed: dict[str, _Group] = {}
        for cid, req in list(self._pending_grammars.items()):
            if not req.structured_output.is_ready:
                continue
            del self._pending_grammars[cid]
            error = req.structured_output.error
            if error is not None and not req.is_finished:
                logger.error("request %s: its grammar failed to compile: %s", cid, error)
                self.scheduler.finish_requests([cid], RequestStatus.FINISHED_ABORTED)
                group = self._child_to_group.get(cid)
                if group is not None:
                    failed[group.request_id] = group
        return list(failed.values())

    def _grammar_bitmask(self, sched_out) -> tuple[list[str], torch.Tensor] | None:
        """The token bitmasks of the constrained requests that sample this step (their last scheduled
        position is their last known token), or None."""
        spec = sched_out.scheduled_spec_decode_tokens
        requests = self.scheduler.requests
        constrained = [
            r
            for r in map(requests.get, sched_out.num_scheduled_tokens)
            if r is not None
            and r.structured_output is not None
            and r.num_computed_tokens + sched_out.num_scheduled_tokens[r.request_id]
            == r.num_tokens + len(spec.get(r.request_id, ()))
        ]
        if not constrained:
            return None
        drafts = [spec.get(r.request_id, []) for r in constrained] if spec else None
        return [r.request_id for r in constrained], self.structured_output.grammar_bitmask(
            constrained, drafts
        )

    def _add_prompt_logprobs(self, child_id: str, part) -> None:
        """Append a step's prompt logprobs to the group's; positions already there (a recompute after
        preemption, a sibling) are skipped, so each prompt token is answered once."""
        group = self._child_to_group.get(child_id)
        if group is None or group.prompt_logprobs is None:
            return
        have = group.prompt_logprobs
        decode = self.tokenizer.decode
        for j, token_id in enumerate(part.token_ids):
            if part.first_index + j != len(have):
                continue
            entry = {
                token_id: Logprob(
                    part.logprobs[j], part.ranks[j], decode([token_id], skip_special_tokens=False)
                )
            }
            for rank, (tid, lp) in enumerate(part.top[j], start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, decode([tid], skip_special_tokens=False))
            have.append(entry)

    def _logprob_dict(self, s) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        out = {s.token_id: Logprob(s.logprob, s.rank, decode([s.token_id], skip_special_tokens=False))}
        for rank, (tid, lp) in enumerate(s.top_logprobs or [], start=1):
            if tid not in out:
                out[tid] = Logprob(lp, rank, decode([tid], skip_special_tokens=False))
        return out

    def _make_output(self, group: _Group, finished: bool) -> RequestOutput:
        completions = []
        for i, (req, detok) in enumerate(zip(group.children, group.detokenizers)):
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.get_next_output_text(req.is_finished, delta=False),
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=group.cumulative_logprob[i],
                    logprobs=group.logprobs[i],
                    finish_reason=req.finish_reason,
                    stop_reason=group.stop_reasons[i],
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=group.metrics,
            prompt_logprobs=group.prompt_logprobs,
            num_cached_tokens=max(0, group.children[0].num_cached_tokens),
        )

    def shutdown(self) -> None:
        """Write the cached blocks to --kv-offload-dir (when set), stop the tensor-parallel workers."""
        if self.kv_offloader is not None:
            self.kv_offloader.shutdown(self.scheduler, self.executor)
        self.executor.shutdown()

    # ---- what the engine holds --------------------------------------------------------------------
    def open_kv_view(self) -> KVCacheView:
        """The read-only view of the KV cache (engine/kv_view.py), recording events until close_kv_view."""
        if self.kv_view is None:
            self.kv_view = KVCacheView(
                self.scheduler, max_model_len=self.max_model_len, block_bytes=self.kv_block_bytes
            )
        return self.kv_view

    def close_kv_view(self) -> None:
        """Stop recording KV events: the engine is back to paying nothing for being watchable."""
        if self.kv_view is not None:
            self.kv_view.close()
            self.kv_view = None

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; False (and nothing dropped) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        kv = s.kv_cache_manager
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_blocks_total=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            spec_decode=self.spec_decoding_stats.copy() if self.spec_decoding_stats is not None else None,
            lora=(
                LoRAStats.of(s, self.lora_config.max_loras, self.runner.lora.names())
                if self.lora_config is not None
                else None
            ),
            kv_offload=self.kv_offloader.stats(kv) if self.kv_offloader is not None else None,
        )
