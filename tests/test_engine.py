"""The engine on the real default model: batching, preemption, prefix sharing, forks, aborts, sampling."""

from __future__ import annotations

import logging

import pytest
from model_helpers import exact_llm

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InputError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain the theory of relativity in simple terms. Albert Einstein proposed that space and time are",
    "Water boils at",
    "Hello",
    "In computer science, a paged KV cache stores the keys and values of attention in fixed-size blocks so that",
    "The best way to learn a new language is",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n",
    "Roses are red, violets are blue,",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through a process "
    "called cellular respiration, which involves glycolysis, the Krebs cycle and",
    "Paris",
    "Machine learning models are trained by",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return exact_llm(num_kv_blocks=1024, max_num_seqs=32)


def engine_free(llm) -> tuple[int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.num_free_blocks, stats.num_blocks_total


def test_batch_equals_each_prompt_alone(llm):
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prompt
        assert out.outputs[0].text == alone.outputs[0].text
        assert out.outputs[0].finish_reason == "length"
    assert engine_free(llm)[0] == engine_free(llm)[1]


def test_preemption_keeps_outputs_identical(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    # 8 requests of up to ~60 tokens need ~30 blocks at once; 12 blocks force preemptions
    tight = exact_llm(num_kv_blocks=12, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS[:8], params, use_tqdm=False)]
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert stats.num_free_blocks == stats.num_blocks_total


def test_shared_system_prompt_blocks_are_stored_once(llm):
    engine = llm.llm_engine
    tok = engine.tokenizer
    system = tok.encode(" ".join(f"rule {i}: be kind and precise." for i in range(40)))[:200]
    assert len(system) == 200
    free_before = engine.get_stats().num_free_blocks
    for i in range(32):
        engine.add_request(
            f"sys-{i}",
            system + tok.encode(f" Question {i}: what is {i} squared?"),
            SamplingParams(temperature=0, max_tokens=4),
        )
    engine.step()  # admits and prefills everyone (the budget holds all 32 prompts)
    running = engine.scheduler.running
    assert len(running) == 32
    shared = [tuple(r.block_ids[:12]) for r in running]  # 200 // 16 = 12 full blocks of the system prompt
    assert len(set(shared)) == 1, "the system prompt's full blocks must be the same physical blocks"
    used = free_before - engine.get_stats().num_free_blocks
    # 12 shared blocks once + each request's own tail (prompt 212..216 tokens -> 2 more blocks each)
    assert used == 12 + 32 * 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits >= 31 * 12 * 16


def test_n4_shares_prompt_blocks_and_copies_the_partial_block(llm):
    engine = llm.llm_engine
    copies = []
    runner = engine.runner
    original = runner.copy_blocks
    runner.copy_blocks = lambda pairs: (copies.extend(pairs), original(pairs))
    try:
        prompt = engine.tokenizer.encode(PROMPTS[2])  # 17 tokens: one full block and a partial one
        assert len(prompt) % 16 != 0
        engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8))
        tables = None
        while engine.has_unfinished_requests():
            engine.step()
            kids = [engine.scheduler.get_request(f"fork#{i}") for i in range(4)]
            if tables is None and all(k is not None and k.num_output_tokens >= 1 for k in kids):
                tables = [list(k.block_ids) for k in kids]
        outs = []
    finally:
        runner.copy_blocks = original
    assert tables is not None
    assert len({t[0] for t in tables}) == 1, "the full prompt block is shared by all four"
    assert len({t[1] for t in tables}) == 4, "each sibling writes into its own copy of the partial block"
    assert len(copies) == 3  # the last holder writes in place
    assert engine_free(llm)[0] == engine_free(llm)[1]
    del outs


def test_n4_returns_four_choices(llm):
    out = llm.generate(
        PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=12), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_abort_running_request_returns_all_blocks(llm):
    engine = llm.llm_engine
    total = engine.get_stats().num_blocks_total
    engine.add_request("long", PROMPTS[5], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.get_stats().num_free_blocks < total
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_free_blocks == total


def test_seed_gives_same_output_whatever_shares_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20)] * 5
    mixed = llm.generate(PROMPTS[:5] + [PROMPTS[1]], others + [seeded], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone


def test_stop_string_is_not_leaked(llm):
    free = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[
        0
    ]
    assert " 6," in free.text  # the model counts on: "1, 2, 3, 4, 5, 6, ..."
    out = llm.generate(
        PROMPTS[3], SamplingParams(temperature=0, max_tokens=20, stop=[" 6,"]), use_tqdm=False
    )[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == " 6,"
    assert c.text == free.text[: free.text.index(" 6,")]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    base = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[
        0
    ]
    stop_id = base.token_ids[3]
    out = llm.generate(
        PROMPTS[3], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert len(out.token_ids) <= 4
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    late = llm.generate(
        PROMPTS[3],
        SamplingParams(temperature=0, max_tokens=10, min_tokens=8, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(late.token_ids) >= 8


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and entry[tid].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_chat_applies_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert "<|im_start|>" not in out.outputs[0].text


def test_request_that_can_never_fit_is_rejected_and_others_go_on(llm):
    engine = llm.llm_engine
    with pytest.raises(InputError, match="context length"):
        engine.add_request("huge", list(range(5, 5 + engine.max_model_len + 1)), SamplingParams(max_tokens=1))
    with pytest.raises(InputError, match="prompt"):
        engine.add_request("empty", [], SamplingParams())
    assert (
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(top_k=2.5), "top_k"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
    ],
)
def test_sampling_params_refuse_non_finite_and_out_of_range(kwargs, field):
    with pytest.raises(InputError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_ids_and_top_k_beyond_the_vocabulary_are_refused_at_add(llm):
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    for kwargs, field in [
        (dict(top_k=vocab + 1), "top_k"),
        (dict(stop_token_ids=[vocab]), "stop_token_ids"),
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InputError) as e:
            engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=2, **kwargs))
        assert e.value.param == field
    assert not engine.has_unfinished_requests()
    # the int64 edge seeds two siblings without overflow (seed + 1 wraps modulo 2^64)
    out = llm.generate([[1, 2, 3]], SamplingParams(n=2, seed=2**63 - 1, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 2


def test_metrics_times_are_ordered(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_startup_log_line_reports_the_kv_cache(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        LLM(model="default", dtype="fp32", num_kv_blocks=100, show_progress=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    # 100 blocks x 16 tokens; 23,040 bytes a token in fp32 x 2 = 46,080 bytes -> 1600 tokens = 70.31 MiB
    assert "100 blocks x 16 tokens = 1600 tokens" in line
    assert "(70.312 MiB)" in line
    assert "max concurrency at 1600 tokens" in line


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
        (dict(dtype="fp12"), "dtype"),
    ],
)
def test_bad_engine_options_fail_before_loading(kwargs, field):
    with pytest.raises(InputError) as e:
        LLM(model="/no/such/model/is/ever/loaded", **kwargs)
    assert e.value.param == field or field in str(e.value)


def test_reset_prefix_cache_makes_the_next_run_prefill_again(llm):
    prompt = "Reset me: " + "the same long prompt, block after block. " * 8
    params = SamplingParams(temperature=0, max_tokens=2)
    engine = llm.llm_engine
    llm.generate([prompt], params, use_tqdm=False)
    hits = engine.get_stats().prefix_cache_hits
    llm.generate([prompt], params, use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits > hits  # the second run found the first's blocks
    assert llm.reset_prefix_cache()
    hits = engine.get_stats().prefix_cache_hits
    llm.generate([prompt], params, use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits == hits


def test_final_only_requests_give_one_output_the_same_as_the_cumulative_last(llm):
    # offline generate asks the engine for final outputs only: no output while a request runs, and the
    # one at its end equal to the last of a request that reported every step
    from dataclasses import replace

    from pagedllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[" 6,"], logprobs=1)
    engine.add_request("every-step", PROMPTS[3], params)
    engine.add_request("final-only", PROMPTS[3], replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"every-step": [], "final-only": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["every-step"]) > 1 and len(seen["final-only"]) == 1
    last, final = seen["every-step"][-1], seen["final-only"][0]
    assert final.finished and last.finished
    assert final.outputs == last.outputs
    assert final.outputs[0].finish_reason == "stop"  # " 6," stopped it before max_tokens


def test_generate_leaves_the_callers_sampling_params_as_they_were(llm):
    from pagedllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
