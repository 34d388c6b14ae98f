"""Speculative decoding under tensor parallelism: proposals come from this process (prompt lookup on token
ids, a draft model loaded whole here), the tensor-parallel ranks verify them as rank 0 alone does at
tensor_parallel_size 1, and the step-cost probe runs through the workers. Greedy outputs equal those of
one process without speculation token for token (fp32), with drafts accepted, so nothing passes vacuously.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import exact_llm
from safetensors.torch import load_file, save_file
from test_spec_decode import COPY, assert_no_block_held
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.budget import StepCost

pytestmark = pytest.mark.slow

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "draft_budget": "off",  # every proposal is verified, whatever a step costs on this machine
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory) -> Path:
    """A random Llama (8 query heads on 4 KV heads: 2 + 2 a rank) whose attention and MLP outputs are
    scaled down to a tenth, so its greedy next token depends mostly on the last one: a random model never
    repeats itself, this one repeats what followed the same tokens before, so prompt lookup's guesses hold."""
    path = save_tiny_llama(
        tmp_path_factory.mktemp("echo") / "llama", seed=3, num_attention_heads=8, num_key_value_heads=4
    )
    file = path / "model.safetensors"
    weights = load_file(file)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def echo_case(echo_model) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that repeat themselves (each text, the model's own continuation of it, the text again), one
    that does not (its rows run beside the verify rows), and their greedy outputs in one process."""
    base = LLM(str(echo_model), dtype="fp32", show_progress=False)
    tokenizer = base.get_tokenizer()
    prompts = []
    for text in ("The paged KV cache stores keys and values in blocks.", "def f(x):\n    return x"):
        ids = tokenizer.encode(text)
        prompts.append(ids + token_ids(base, [ids])[0] + ids)
    prompts.append(tokenizer.encode("Hello"))
    return prompts, token_ids(base, prompts)


def tp2(model, **kwargs) -> LLM:
    """tensor_parallel_size 2 with small chunks: prefills are chunked, and run beside decodes and drafts."""
    return LLM(
        model=str(model),
        dtype="fp32",
        show_progress=False,
        tensor_parallel_size=2,
        max_num_batched_tokens=32,
        **kwargs,
    )


def test_ngram_under_tp2_equals_one_process_without_speculation(echo_model, echo_case):
    prompts, want = echo_case
    llm = tp2(echo_model, speculative_config=NGRAM)
    try:
        assert token_ids(llm, prompts) == want
        spec = llm.llm_engine.get_stats().spec_decode
        assert spec.num_accepted_tokens > 0, spec  # guesses held: runs of several tokens came out of a step
        assert spec.num_accepted_tokens < spec.num_draft_tokens, spec  # and some were rejected
        assert_no_block_held(llm)
        # the step-cost probe goes through the executor: the workers run its decode steps, then forget them
        engine = llm.llm_engine
        cost = StepCost.measure(engine.executor, engine.scheduler.kv_cache_manager, rows=(1, 2, 4), repeats=1)
        assert cost.rows == (1, 2, 4) and all(t > 0 for t in cost.seconds)
        assert token_ids(llm, prompts[:1]) == want[:1]
    finally:
        llm.llm_engine.shutdown()


def test_ngram_in_one_process_equals_without(echo_model, echo_case):
    prompts, want = echo_case
    llm = LLM(str(echo_model), dtype="fp32", show_progress=False, speculative_config=NGRAM)
    assert token_ids(llm, prompts) == want
    assert llm.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_draft_model_under_tp2_runs_whole_in_the_engine_process(echo_model, echo_case):
    """Self-speculation: the echo model drafts for itself, whole in this process, while the two ranks hold
    its halves. The draft budget is measured at start through the workers, then set free, so that every
    proposal is verified."""
    prompts, want = echo_case
    config = {"method": "draft_model", "model": str(echo_model), "num_speculative_tokens": 3}
    llm = tp2(echo_model, speculative_config=config)
    try:
        engine = llm.llm_engine
        assert engine.runner is None and engine.proposer.runner.model is not None
        assert len(engine.step_cost.rows) > 1  # measured at several row counts, through the executor
        engine.step_cost = StepCost.linear(fixed=1.0, per_row=0.0)
        assert token_ids(llm, prompts) == want
        spec = engine.get_stats().spec_decode
        assert spec.num_accepted_tokens > spec.num_draft_tokens / 2, spec  # the same model guesses well
        assert_no_block_held(llm)
    finally:
        llm.llm_engine.shutdown()


def test_default_model_copying_under_tp2_equals_one_process():
    """The default model (3 KV heads: 2 + 1) copying a passage: prompt lookup's guesses mostly hold."""
    params = SamplingParams(temperature=0, max_tokens=32)
    want = token_ids(exact_llm(), [COPY], params)
    llm = LLM(model="default", dtype="fp32", quantization="none", show_progress=False,
              tensor_parallel_size=2, speculative_config=NGRAM)  # fmt: skip
    try:
        assert token_ids(llm, [COPY], params) == want
        spec = llm.llm_engine.get_stats().spec_decode
        assert spec.acceptance_rate > 0.5, spec
    finally:
        llm.llm_engine.shutdown()
