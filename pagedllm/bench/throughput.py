"""Offline throughput, like `vllm bench throughput`: every prompt submitted at once, run to the end."""

from __future__ import annotations

import time

from pagedllm.bench.dataset import BenchPrompt


def run_offline(
    llm,
    prompts: list[BenchPrompt],
    ignore_eos: bool = True,
    use_tqdm: bool = True,
    structured_outputs=None,
) -> dict:
    """structured_outputs: a StructuredOutputsParams every request is constrained by (None: none)."""
    from pagedllm.sampling_params import SamplingParams

    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=p.max_tokens,
            ignore_eos=ignore_eos,
            structured_outputs=structured_outputs,
        )
        for p in prompts
    ]
    # every run starts cold: a repeat must not find the previous run's prompts in the prefix cache
    llm.reset_prefix_cache()
    before = llm.llm_engine.get_stats().spec_decode
    start = time.perf_counter()
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    spec = _spec_decode_figures(before, llm.llm_engine.get_stats().spec_decode)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    # per-request decode speed after the first token (single50: the single-stream decode tok/s)
    decode = sorted(
        (len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_time - o.metrics.first_token_time)
        for o in outs
        if len(o.outputs[0].token_ids) > 1 and o.metrics.finished_time > o.metrics.first_token_time
    )
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "median_ttft_s": ttfts[len(ttfts) // 2],
        "decode_tokens_per_second": decode[len(decode) // 2] if decode else 0.0,
        **bytes_per_token(llm),
        **spec,
    }


def bytes_per_token(llm) -> dict:
    """{"bytes_per_token": weight bytes a single-stream decode step of the engine's built model reads}
    (roofline.py), or {} when the model is not in this process (tensor parallelism: the workers hold it)."""
    from pagedllm.bench.roofline import model_bytes_per_token

    model = llm.llm_engine.model
    return {} if model is None else {"bytes_per_token": model_bytes_per_token(model)}


def _spec_decode_figures(before, after) -> dict:
    """This run's speculative decoding (vLLM's names): drafts, draft and accepted tokens, the acceptance
    rate and the mean acceptance length (1 + accepted / drafts: tokens a verify step yields); {} when off."""
    if after is None:
        return {}
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def summarize(r: dict) -> dict:
    """vLLM's keys (elapsed_time, num_requests, total_num_tokens, requests_per_second, tokens_per_second)."""
    total = r["prompt_tokens"] + r["output_tokens"]
    return {
        "elapsed_time": r["elapsed_time"],
        "num_requests": r["num_requests"],
        "total_num_tokens": total,
        "requests_per_second": r["num_requests"] / r["elapsed_time"],
        "tokens_per_second": total / r["elapsed_time"],
        "output_tokens_per_second": r["output_tokens"] / r["elapsed_time"],
        **{k: v for k, v in r.items() if k not in ("elapsed_time", "num_requests")},
    }
