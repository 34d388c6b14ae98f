"""--batch-invariant (`LLM(batch_invariant=True)`): on the default model served from its GGUF blocks (bf16 or
the engine's default dtype), a prompt's greedy tokens are the same alone, in a batch of 32 different
prompts (prompts chunked by the token budget, a batch that does not fit the KV cache and is preempted and
recomputed), with n-gram speculative decoding, and on one of two data-parallel replicas; what the mode
cannot make invariant is refused, naming it.

The engines here run a token budget of 64 and 64 KV blocks, so that 32 short prompts are chunked and
preempted as W32's prompts are at the default budget: without the flag (everything else the same) the batch,
the speculative batch and the replicas each gave other tokens than alone for some of the CHECKED prompts on
the AVX-512 BF16 machine these tests were written on (a prompt chunked at other boundaries, or recomputed
after a preemption, attends through the prefill path in another order; the int8 rounding of the
activations turns such differences into whole steps now and then). Prompts are compared where they are
checked alone (CHECKED), to keep the suite short.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams, ops
from pagedllm.errors import InputError
from pagedllm.quantization import woq_kernels
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.rtn import rtn_quantize_weight
from pagedllm.spec_decode.budget import StepCost

pytestmark = pytest.mark.slow

ENGINE = dict(
    model="default",
    batch_invariant=True,
    max_num_batched_tokens=64,
    num_kv_blocks=64,
    max_num_seqs=32,
    show_progress=False,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

PASSAGE = (
    "The paged KV cache stores the keys and values of attention in fixed-size blocks. Each sequence has a "
    "block table that maps its logical blocks to physical ones, so memory is allocated on demand and "
    "shared between sequences with the same prefix."
)


def chat(text: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def _prompts() -> list[str]:
    """32 different prompts, 11 to 205 tokens: chat turns sharing a system prompt, copy tasks, counting,
    code, and passages."""
    topics = ["the sea", "a red fox", "compilers", "the moon", "bread", "rain in Paris", "a lighthouse",
              "chess", "volcanoes", "jazz", "a library", "trains", "honeybees", "winter", "the desert", "robots"]  # fmt: skip
    out = []
    for i, topic in enumerate(topics):
        out.append(chat(f"Write a short poem about {topic}."))
        out.append(
            (
                f"Chapter {i}. " + PASSAGE * (1 + i // 4) + f" In summary, {topic}",
                chat(f"Repeat exactly: {PASSAGE} {topic}."),
                f"{i}, {i + 1}, {i + 2}, {i + 3},",
                f"def f{i}(x):\n    return x * {i}\n\ndef g{i}(y):\n",
            )[i % 4]
        )
    return out


PROMPTS = _prompts()
# compared with their outputs alone: ones whose tokens moved without the flag in the batch, the speculative
# batch or on the replicas (1, 7, 12, 15, 16, 18, 22, 24, 28: each scenario moved two or more of them at
# bf16, and at fp32 under PAGEDLLM_CPU_ISA=avx2 too), a copy prompt the n-gram proposer guesses well (3) and
# the longest prompt (25)
CHECKED = (1, 3, 7, 12, 15, 16, 18, 22, 24, 25, 28)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def alone(llm) -> dict[int, list[int]]:
    """Each checked prompt's tokens with nothing else in the engine and nothing cached."""
    out = {}
    for i in CHECKED:
        assert llm.reset_prefix_cache()
        out[i] = token_ids(llm.generate(PROMPTS[i], GREEDY, use_tqdm=False))[0]
    return out


def assert_checked_equal(got: list[list[int]], alone: dict[int, list[int]]) -> None:
    for i in CHECKED:
        assert got[i] == alone[i], (i, PROMPTS[i])
        assert len(got[i]) == GREEDY.max_tokens


def test_batch_of_32_chunked_and_preempted_equals_alone(llm, alone):
    before = llm.llm_engine.get_stats().num_preemptions
    got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.llm_engine.get_stats().num_preemptions > before  # 64 blocks: the batch did not fit
    assert_checked_equal(got, alone)


def test_a_prompts_logprobs_are_its_decodes(llm):
    """The prompt + output scored as one (chunked) prompt gives each output token the logprob it was sampled
    with: a prompt's rows are computed as decodes (without the flag they differed by up to 0.14)."""
    with_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPTS[25], with_logprobs, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    sampled = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    prompt = list(out.prompt_token_ids)
    scored = llm.generate(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for lp, t, want in zip(scored.prompt_logprobs[len(prompt) :], tokens, sampled, strict=True):
        assert lp[t].rank == 1  # greedy: the output token was the most likely one
        assert lp[t].logprob == pytest.approx(want, abs=1e-4)  # the same logits; log_softmax's rounding aside


def test_ngram_speculation_equals_alone(alone):
    ngram = LLM(**ENGINE, speculative_config=NGRAM)
    ngram.llm_engine.step_cost = StepCost.linear(fixed=1.0, per_row=0.0)  # verify every proposal
    assert_checked_equal(token_ids(ngram.generate(PROMPTS, GREEDY, use_tqdm=False)), alone)
    accepted = ngram.llm_engine.get_stats().spec_decode.num_accepted_tokens
    assert ngram.reset_prefix_cache()
    assert token_ids(ngram.generate(PROMPTS[3], GREEDY, use_tqdm=False))[0] == alone[3]  # speculating alone
    assert ngram.llm_engine.get_stats().spec_decode.num_accepted_tokens > accepted


def test_two_data_parallel_replicas_equal_alone(alone, monkeypatch):
    pytest.importorskip("ray")
    from pagedllm.engine.data_parallel import DataParallelEngine

    temp_dir = f"/tmp/pgbi-{os.getpid()}"  # Ray's own files; short: its socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    engine = DataParallelEngine(dict(ENGINE), 2)  # a local Ray, one replica process (one thread) each

    async def one(i: int) -> list[int]:
        last = None
        async for out in engine.generate(PROMPTS[i], GREEDY, f"bi-{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    async def run() -> list[list[int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        finally:
            await engine.shutdown()

    try:
        got = asyncio.run(run())
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert_checked_equal(got, alone)


# ---- what the mode refuses, naming it ---------------------------------------------------------------


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size 2"),
        (dict(quantization="none"), "dense linears"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype int8"),
    ],
)
def test_refused_before_the_model_loads(options, named):
    with pytest.raises(InputError, match=named) as e:
        LLM(model="default", batch_invariant=True, show_progress=False, **options)
    assert e.value.param == "batch_invariant"
    assert str(e.value).startswith("batch_invariant cannot be kept with")


def test_a_dense_linear_in_the_built_model_is_refused_by_name(tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")  # int8 at load quantizes the decoder linears, not the lm_head
    with pytest.raises(InputError, match="lm_head, a dense linear") as e:
        LLM(model=str(path), quantization="int8", batch_invariant=True, show_progress=False)
    assert e.value.param == "batch_invariant"


def test_building_invariant_keeps_to_row_invariant_kernels():
    layer = QuantLinear.from_quantized(rtn_quantize_weight(torch.randn(32, 64), 4, 32))
    with ops.forced(quantized_linear="torch-packed"):  # a backend with no row-invariant kernel
        assert woq_kernels.choose(layer, torch.bfloat16).name == "torch-packed"
        with ops.batch_invariant():
            assert ops.building_batch_invariant()
            # the reference, which the engine refuses
            assert woq_kernels.choose(layer, torch.bfloat16) is None
    assert not ops.building_batch_invariant()
    with ops.batch_invariant():  # the table's backend: at the amx tier too, the avx2 kernel
        kernel = woq_kernels.choose(layer, torch.bfloat16)
    assert kernel is None or kernel.name in ops.ROW_INVARIANT_QUANTIZED_KERNELS
    if ops.backend("quantized_linear") in ("amx", "avx2"):
        assert kernel is not None


def test_the_flag_reaches_the_engine():
    import argparse

    from pagedllm.entrypoints.cli.bench import _engine_flags
    from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] is False
    # `bench serve --launch` passes it on to `pagedllm serve` as the flag it is
    assert "--batch-invariant" in _engine_flags(parser.parse_args(["--batch-invariant"]))
    assert "--batch-invariant" not in _engine_flags(parser.parse_args([]))
