"""Speculative decoding in the engine: with prompt lookup or a draft model, greedy outputs are the outputs
without, token for token (single requests, a batch of 32, preemption, a cached prefix, stops, logprobs,
n > 1, streaming, structured outputs), sampled outputs keep their distribution, and no block is left."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_helpers import exact_llm
from scipy.stats import chi2_contingency
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.errors import InputError
from pagedllm.spec_decode.budget import StepCost

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "default", "quantization": "gguf", "num_speculative_tokens": 3}

PASSAGE = (
    "The paged KV cache stores the keys and values of attention in fixed-size blocks. Each sequence has a "
    "block table that maps its logical blocks to physical ones, so memory is allocated on demand and "
    "shared between sequences with the same prefix."
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


COPY = chat(f"Repeat the following text exactly:\n{PASSAGE}")
PROMPTS = [
    COPY,
    chat(f"Fix the typos: {PASSAGE.replace('blocks', 'blcoks')}"),
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "Hello",
    chat("Write a haiku about the sea."),
    PASSAGE + " " + PASSAGE[:80],
]


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def plain():
    return exact_llm(num_kv_blocks=1024, max_num_seqs=32)


def verify_everything(llm):
    """Rows are free: every proposal is verified, whatever the step-cost measurement on this machine says
    (these tests are about outputs; the budget has its own, at a fixed cost)."""
    llm.llm_engine.step_cost = StepCost.linear(fixed=1.0, per_row=0.0)
    return llm


@pytest.fixture(scope="module")
def ngram():
    return verify_everything(exact_llm(num_kv_blocks=1024, max_num_seqs=32, speculative_config=NGRAM))


def token_ids(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_block_held(llm) -> None:
    engine = llm.llm_engine
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks_total
    proposer = engine.proposer
    if hasattr(proposer, "kv"):  # the draft model's own pool
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks and not proposer.mirrors


def test_ngram_greedy_equals_plain_one_request_at_a_time(plain, ngram):
    before = ngram.llm_engine.get_stats().spec_decode.num_accepted_tokens
    for prompt in PROMPTS[:4]:
        assert token_ids(ngram, prompt, greedy(48)) == token_ids(plain, prompt, greedy(48)), prompt
    spec = ngram.llm_engine.get_stats().spec_decode
    assert spec.num_accepted_tokens - before > 20  # the copy prompts really speculated and held
    assert_no_block_held(ngram)


def test_ngram_batch_of_32_with_mixed_lengths_equals_plain(plain, ngram):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    params = [greedy(8 + 5 * (i % 7), ignore_eos=i % 2 == 0) for i in range(32)]
    got, want = token_ids(ngram, prompts, params), token_ids(plain, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (i, prompts[i])
        assert len(g) <= params[i].max_tokens
    assert_no_block_held(ngram)


def test_ngram_with_preemption_forced_equals_plain(plain):
    # 12 blocks of 16 tokens for 6 requests of up to ~110 tokens: they cannot all run at once
    small = verify_everything(
        exact_llm(num_kv_blocks=12, max_num_batched_tokens=64, speculative_config=NGRAM)
    )
    prompts = PROMPTS[:6]
    got = token_ids(small, prompts, greedy(40, ignore_eos=True))
    assert small.llm_engine.get_stats().num_preemptions > 0
    assert got == token_ids(plain, prompts, greedy(40, ignore_eos=True))
    assert_no_block_held(small)


def test_ngram_after_a_cached_prefix_equals_plain(plain, ngram):
    ngram.generate(COPY, greedy(4), use_tqdm=False)  # the prompt's blocks are now cached
    queries = ngram.llm_engine.get_stats().prefix_cache_hits
    assert token_ids(ngram, COPY, greedy(48)) == token_ids(plain, COPY, greedy(48))
    assert ngram.llm_engine.get_stats().prefix_cache_hits > queries


def test_only_verified_tokens_enter_the_prefix_cache(ngram):
    """A rejected draft's block is never findable: after a run with rejections, the prefix cache holds a
    block only under the hash of the tokens the request really produced."""
    ngram.reset_prefix_cache()
    out = ngram.generate(PROMPTS[1], greedy(64, ignore_eos=True), use_tqdm=False)[0]
    spec = ngram.llm_engine.get_stats().spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # there were rejections
    manager = ngram.llm_engine.scheduler.kv_cache_manager
    from pagedllm.core.block_pool import hash_block_tokens

    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    parent, known = None, set()
    for i in range(len(tokens) // 16):
        parent = hash_block_tokens(parent, tokens[i * 16 : (i + 1) * 16])
        known.add(parent)
    assert set(manager.block_pool.cached_block_hash_to_block) <= known


def test_stops_inside_an_accepted_run_end_where_they_would_without(plain, ngram):
    want = plain.generate(COPY, greedy(60), use_tqdm=False)[0].outputs[0]
    # a stop string, a stop token and max_tokens that fall in the middle of what prompt lookup guesses
    word = want.text.split()[6]
    for params in (
        greedy(60, stop=[word]),
        greedy(60, stop_token_ids=[want.token_ids[9]]),
        greedy(13),
        greedy(60, stop=[word], include_stop_str_in_output=True),
    ):
        a = ngram.generate(COPY, params, use_tqdm=False)[0].outputs[0]
        b = plain.generate(COPY, params, use_tqdm=False)[0].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        ), params
    assert_no_block_held(ngram)


def test_min_tokens_holds_eos_back_on_every_verified_row(plain, ngram):
    """EOS is banned on the rows before min_tokens even when later rows of the same run are past it."""
    for prompt in (chat("Say hi."), chat("Repeat exactly: hi hi hi hi")):
        natural = len(token_ids(plain, prompt, greedy(40))[0])
        for min_tokens in (natural + 1, natural + 3):
            params = greedy(60, min_tokens=min_tokens)
            got = token_ids(ngram, prompt, params)[0]
            assert got == token_ids(plain, prompt, params)[0], (prompt, min_tokens)
            assert len(got) >= min_tokens


def test_logprobs_are_the_targets(plain, ngram):
    params = greedy(24, logprobs=3)
    a = ngram.generate(COPY, params, use_tqdm=False)[0].outputs[0]
    b = plain.generate(COPY, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == list(y)
        assert np.allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()], atol=1e-4)
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_n_greater_than_one_and_seeded_sampling(plain, ngram):
    assert token_ids(ngram, COPY, greedy(24, n=1)) == token_ids(plain, COPY, greedy(24))
    out = ngram.generate(COPY, greedy(24, n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [token_ids(plain, COPY, greedy(24))[0]] * 3
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, n=2)
    first = [c.token_ids for c in ngram.generate(COPY, sampled, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in ngram.generate(COPY, sampled, use_tqdm=False)[0].outputs]
    assert first == again  # the same seed and the same drafts: the same tokens
    assert_no_block_held(ngram)


def test_streaming_emits_every_accepted_token(plain, ngram):
    deltas = [c.token_ids for out in ngram.stream(COPY, greedy(48)) for c in out.outputs]
    assert max(len(d) for d in deltas) > 1  # several tokens a step came through
    assert [t for d in deltas for t in d] == token_ids(plain, COPY, greedy(48))[0]


def test_structured_outputs_with_speculation_equal_plain(plain, ngram):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
    prompt = chat('Repeat this JSON: {"name": "block table", "tags": ["block table", "block table"]}')
    params = greedy(48, structured_outputs=StructuredOutputsParams(json=schema))
    a = ngram.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    json.loads(a.text)


def test_draft_model_greedy_equals_plain_and_gives_its_blocks_back(plain):
    """Self-speculation: the default model's GGUF blocks served natively draft for the same model in fp32."""
    llm = verify_everything(exact_llm(num_kv_blocks=512, max_num_seqs=8, speculative_config=DRAFT))
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[6]]
    params = [greedy(20 + 4 * i) for i in range(4)]
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    spec = llm.llm_engine.get_stats().spec_decode
    assert spec.acceptance_rate > 0.5  # the same model quantized guesses well
    assert spec.num_accepted_tokens_per_pos == sorted(spec.num_accepted_tokens_per_pos, reverse=True)
    assert_no_block_held(llm)
    # its KV shares the budget: the same memory holds fewer blocks than without a draft
    with_draft = exact_llm(
        kv_cache_memory="64MiB", speculative_config=DRAFT
    ).llm_engine.cache_config.num_blocks
    without = exact_llm(kv_cache_memory="64MiB").llm_engine.cache_config.num_blocks
    assert with_draft == without // 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=3))


def test_random_weight_checkpoint_greedy_equals_plain_with_both_methods(tiny):
    params = greedy(24, ignore_eos=True)
    base = LLM(tiny, dtype="fp32", show_progress=False)
    # a random model never repeats itself: give prompt lookup something to find, each prompt followed by
    # the model's own continuation and the prompt again (its guesses are then mostly rejected)
    prompts = []
    for text in (PASSAGE, "a b a b a b a b", "def f(x):\n    return x"):
        ids = base.get_tokenizer().encode(text)
        prompts.append(ids + token_ids(base, ids, params)[0] + ids)
    want = token_ids(base, prompts, params)
    for config in (NGRAM, {"method": "draft_model", "model": tiny, "num_speculative_tokens": 2}):
        llm = verify_everything(LLM(tiny, dtype="fp32", show_progress=False, speculative_config=config))
        assert token_ids(llm, prompts, params) == want, config
        assert llm.llm_engine.get_stats().spec_decode.num_drafts > 0
        assert_no_block_held(llm)


def test_a_draft_that_guesses_wrong_changes_nothing(plain, tiny):
    """A random-weight draft with the default tokenizer: its guesses are rejected (their KV slots and blocks
    go back), the engine soon stops asking it, and the greedy output is still the target's."""
    llm = exact_llm(
        num_kv_blocks=256,
        speculative_config={"method": "draft_model", "model": tiny, "num_speculative_tokens": 4},
    )
    llm.llm_engine.step_cost = StepCost.linear(fixed=7e-3, per_row=3.7e-3)  # the budget at a fixed cost
    assert token_ids(llm, PROMPTS[:3], greedy(24)) == token_ids(plain, PROMPTS[:3], greedy(24))
    spec = llm.llm_engine.get_stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.acceptance_rate < 0.3
    assert spec.num_draft_tokens < 24  # backed off: far fewer guesses than the 3 x 23 it could have made
    assert_no_block_held(llm)


class _GreedyPathProposer:
    """Proposes the target's own greedy continuation of the prompt from wherever the output stands: at
    temperature 1 these guesses are accepted often but not always, which exercises both branches."""

    max_len = None

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.continuation = prompt_len, continuation

    def propose(self, requests, num_tokens):
        out = {}
        for r in requests:
            at = r.num_output_tokens
            out[r.request_id] = self.continuation[at : at + num_tokens[r.request_id]]
        return out

    def remove(self, request_ids):
        pass

    def retain(self, request_ids):
        pass


def test_sampled_outputs_follow_the_same_distribution_with_speculation(tiny):
    """Chi-square over 600 seeded draws of tokens 2-4 (the first comes from the prefill; top-k 3: 27 cells):
    speculation on and off agree; the same test with the acceptance rule broken (drafts always accepted)
    fails it."""
    prompt = "a b a b a b"
    base = LLM(tiny, dtype="fp32", show_progress=False, max_num_seqs=64)
    continuation = token_ids(base, prompt, greedy(8))[0]
    spec = LLM(tiny, dtype="fp32", show_progress=False, max_num_seqs=64, speculative_config=NGRAM)
    prompt_len = len(base.get_tokenizer().encode(prompt))
    spec.llm_engine.proposer = _GreedyPathProposer(prompt_len, continuation)
    verify_everything(spec)
    n = 600

    def draws(llm, offset):
        params = [
            SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=offset + i)
            for i in range(n)
        ]
        return [tuple(ids[1:]) for ids in token_ids(llm, [prompt] * n, params)]

    def table(a, b):
        cells = sorted(set(a) | set(b))
        return np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]])

    off = draws(base, 0)
    on = draws(spec, 10_000)
    assert spec.llm_engine.get_stats().spec_decode.num_accepted_tokens > n / 4  # guesses were taken
    assert chi2_contingency(table(off, on)).pvalue > 0.001

    import pagedllm.worker.rejection_sampler as rs

    accept, rs._accept_random = rs._accept_random, lambda probs, first, drafts, gen: len(drafts)
    try:
        broken = draws(spec, 20_000)
    finally:
        rs._accept_random = accept
    assert chi2_contingency(table(off, broken)).pvalue < 1e-6


def test_speculative_config_errors_name_the_field():
    with pytest.raises(InputError, match="speculative_config.method"):
        LLM("default", speculative_config={"method": "medusa"})
    with pytest.raises(InputError, match="speculative_config.model"):
        LLM("default", speculative_config={"method": "draft_model", "model": "/nonexistent.gguf"})
