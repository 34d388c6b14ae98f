"""How many requests a KV budget holds: paged blocks vs max-length reservation, and what a shared prefix saves.

Measured, not computed: we build the engine's real cache and scheduler configuration (an LLMEngine, so
the block count is exactly what `pagedllm serve` would get for the same options), then drive a fresh
KVCacheManager of that configuration directly with Request objects and allocate_slots, the calls the
scheduler makes, without running the model: the prompt is allocated as one prefill, then the output as
decode growth. Each request is counted at its full length (prompt + output), the most it ever holds.
Beside each measurement, the planner's formula (pagedllm.planner) predicts the same number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tqdm.auto import tqdm

from pagedllm import planner
from pagedllm.config import CacheConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


@dataclass
class LengthMix:
    """Requests of prompt + output tokens, total uniform in [min_len, max_len], seeded."""

    prompt_lens: list[int]
    output_lens: list[int]

    @property
    def totals(self) -> list[int]:
        return [p + o for p, o in zip(self.prompt_lens, self.output_lens)]


def length_mix(n: int, min_len: int, max_len: int, seed: int = 0) -> LengthMix:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        total = rng.randint(min_len, max_len)
        prompt = max(
            1, round(total * rng.uniform(0.2, 0.8))
        )  # chat-like: some long prompts, some long answers
        prompts.append(min(prompt, total - 1))
        outputs.append(total - prompts[-1])
    return LengthMix(prompts, outputs)


def new_manager(cache: CacheConfig, prefix_caching: bool | None = None) -> KVCacheManager:
    """A KVCacheManager built as the Scheduler builds it, from the engine's CacheConfig."""
    enable = cache.enable_prefix_caching if prefix_caching is None else prefix_caching
    return KVCacheManager(cache.num_blocks, cache.block_size, enable)


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _admit(kv: KVCacheManager, req: Request, prompt_len: int, output_len: int) -> bool:
    """Prefill the prompt (reusing cached prefix blocks), then grow by the output. False: it does not fit."""
    computed, n = kv.get_computed_blocks(req)
    if not kv.allocate_slots(req, prompt_len - n, computed):
        return False
    req.num_computed_tokens = prompt_len
    req.output_token_ids = [0] * output_len  # the tokens decode will have appended
    if not kv.allocate_slots(req, output_len):
        kv.free(req)
        return False
    req.num_computed_tokens += output_len
    return True


def count_fits(cache: CacheConfig, mix: LengthMix, reserve: int | None, seed: int = 0) -> tuple[int, int]:
    """Admit the mix's requests in order until one does not fit: (how many fit, blocks they hold).

    reserve=None: paged, each holds blocks for its own prompt + output. reserve=N: each reserves N slots
    (max_model_len) up front, as a contiguous per-request cache does. Prompts are distinct random tokens,
    so no prefix is shared here.
    """
    kv = new_manager(cache)
    rng = random.Random(seed)
    fits = 0
    for i, (prompt_len, output_len) in enumerate(zip(mix.prompt_lens, mix.output_lens)):
        grow = output_len if reserve is None else reserve - prompt_len
        prompt = [i] + [rng.randrange(1000, 30000) for _ in range(prompt_len - 1)]
        if not _admit(kv, _request(f"r{i}", prompt, grow), prompt_len, grow):
            break
        fits += 1
    return fits, kv.num_blocks - kv.num_free_blocks


def planner_fits(totals: list[int], num_blocks: int, block_size: int) -> int:
    """The planner's answer: requests fit while the sum of their ceil(len / block_size) blocks fits."""
    used = fits = 0
    for total in totals:
        used += planner.waste(None, block_size, total).blocks_per_request
        if used > num_blocks:
            break
        fits += 1
    return fits


def shared_prefix_blocks(
    cache: CacheConfig, num_requests: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0
) -> dict:
    """Blocks held by num_requests requests that share a prefix_len-token system prompt, with and without
    prefix caching, measured; and the planner's arithmetic for both."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 30000) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(1000, 30000) for _ in range(suffix_len)] for _ in range(num_requests)]
    held = {}
    for caching in (False, True):
        kv = new_manager(cache, prefix_caching=caching)
        for i, p in enumerate(prompts):
            if not _admit(kv, _request(f"s{i}", p, output_len), len(p), output_len):
                raise ValueError(
                    f"{num_requests} requests of {len(p) + output_len} tokens do not fit the cache"
                )
        held[caching] = kv.num_blocks - kv.num_free_blocks
    bs = cache.block_size
    per_request = planner.waste(None, bs, prefix_len + suffix_len + output_len).blocks_per_request
    shared = prefix_len // bs  # only full blocks are shared: the one the suffix starts in differs
    return {
        "num_requests": num_requests,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "output_len": output_len,
        "blocks_without_prefix_caching": held[False],
        "blocks_with_prefix_caching": held[True],
        "blocks_saved": held[False] - held[True],
        "planner_blocks_without": num_requests * per_request,
        "planner_blocks_with": shared + num_requests * (per_request - shared),
    }


def run_memory(
    engine,
    num_requests: int = 256,
    min_len: int = 50,
    max_len: int = 2000,
    prefix_requests: int = 16,
    prefix_len: int = 200,
    seed: int = 0,
    use_tqdm: bool = True,
) -> dict:
    """The whole memory report for an LLMEngine (only its configuration is used, not its model)."""
    cache: CacheConfig = engine.cache_config
    cfg = engine.model_config
    max_model_len = engine.max_model_len
    max_len = min(max_len, max_model_len)
    mix = length_mix(num_requests, min_len, max_len, seed)
    totals = mix.totals
    bar = tqdm(total=3, desc="bench memory", disable=not use_tqdm)
    paged, paged_blocks = count_fits(cache, mix, None, seed)
    bar.update(1)
    naive, naive_blocks = count_fits(cache, mix, max_model_len, seed)
    bar.update(1)
    prefix = shared_prefix_blocks(cache, prefix_requests, prefix_len, 50, 100, seed)
    bar.update(1)
    bar.close()

    bs = cache.block_size
    kv_dtype = _dtype_name(engine)
    per_token = planner.kv_bytes_per_token(cfg.num_layers, cfg.kv_width, kv_dtype)
    budget = cache.num_blocks * planner.block_bytes(bs, per_token)
    naive_planner = planner.capacity(
        budget, planner.kv_bytes(1, max_model_len, cfg.num_layers, cfg.kv_width, kv_dtype)
    )
    fitted = totals[:paged]
    report = {
        "num_blocks": cache.num_blocks,
        "block_size": bs,
        "kv_cache_dtype": kv_dtype,
        "kv_bytes_per_token": per_token,
        "kv_cache_bytes": budget,
        "max_model_len": max_model_len,
        "length_mix": {"num_requests": num_requests, "min_len": min_len, "max_len": max_len, "seed": seed},
        "paged_fits": paged,
        "paged_blocks_used": paged_blocks,
        "naive_fits": naive,
        "naive_blocks_used": naive_blocks,
        "planner_paged_fits": planner_fits(totals, cache.num_blocks, bs),
        "planner_naive_fits": naive_planner.max_concurrent,
        "paged_waste_tokens": sum(planner.waste(None, bs, t).paged_waste_tokens for t in fitted),
        "naive_waste_tokens_at_naive_fits": sum(max_model_len - t for t in totals[:naive]),
        "mean_len_of_fitted": sum(fitted) / max(1, len(fitted)),
        "shared_prefix": prefix,
    }
    report["paged_over_naive"] = paged / naive if naive else float("inf")
    report["planner_agrees"] = (
        report["planner_paged_fits"] == paged
        and report["planner_naive_fits"] == naive
        and prefix["planner_blocks_without"] == prefix["blocks_without_prefix_caching"]
        and prefix["planner_blocks_with"] == prefix["blocks_with_prefix_caching"]
    )
    return report


def _dtype_name(engine) -> str:
    import torch

    kv = engine.cache_config.kv_cache_dtype
    if kv != "auto":
        return kv
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[engine.dtype]


def format_report(r: dict) -> str:
    p = r["shared_prefix"]
    ok = lambda a, b: "agree" if a == b else "DIFFER"  # noqa: E731
    lines = [
        f"KV cache: {r['num_blocks']} blocks x {r['block_size']} tokens ({r['kv_cache_bytes'] / 2**20:.1f} MiB, "
        f"{r['kv_cache_dtype']}, {r['kv_bytes_per_token']} B/token); max_model_len {r['max_model_len']}",
        f"length mix: {r['length_mix']['num_requests']} requests, prompt+output uniform in "
        f"[{r['length_mix']['min_len']}, {r['length_mix']['max_len']}] tokens, seed {r['length_mix']['seed']}",
        f"{'':<34}{'measured':>10}{'planner':>10}",
        f"{'paged: requests that fit':<34}{r['paged_fits']:>10}{r['planner_paged_fits']:>10}  "
        f"{ok(r['paged_fits'], r['planner_paged_fits'])}",
        f"{'naive (max_model_len each)':<34}{r['naive_fits']:>10}{r['planner_naive_fits']:>10}  "
        f"{ok(r['naive_fits'], r['planner_naive_fits'])}",
        f"paged / naive: {r['paged_over_naive']:.1f}x; paged waste {r['paged_waste_tokens']} slots in "
        f"{r['paged_fits']} requests, naive waste {r['naive_waste_tokens_at_naive_fits']} slots in {r['naive_fits']}",
        f"shared prefix: {p['num_requests']} requests, {p['prefix_len']}-token system prompt + {p['suffix_len']} "
        f"own + {p['output_len']} output tokens",
        f"{'  blocks without prefix caching':<34}{p['blocks_without_prefix_caching']:>10}"
        f"{p['planner_blocks_without']:>10}  {ok(p['blocks_without_prefix_caching'], p['planner_blocks_without'])}",
        f"{'  blocks with prefix caching':<34}{p['blocks_with_prefix_caching']:>10}"
        f"{p['planner_blocks_with']:>10}  {ok(p['blocks_with_prefix_caching'], p['planner_blocks_with'])}",
        f"  saved: {p['blocks_saved']} blocks ({p['blocks_saved'] / p['blocks_without_prefix_caching']:.0%})",
        f"planner agreement: {'yes' if r['planner_agrees'] else 'NO'}",
    ]
    return "\n".join(lines)
