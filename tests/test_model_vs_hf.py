"""Our Llama over the paged cache against HF transformers loading the same checkpoint, in fp32."""

from __future__ import annotations

import pytest
import torch
import transformers
from model_helpers import paged_prefill_logits
from tiny_models import save_tiny_llama, save_tiny_qwen2

from pagedllm import LLM, SamplingParams
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint, resolve_model_path

PROMPT_LENGTHS = [1, 15, 16, 17, 100]


def our_model(path) -> LlamaForCausalLM:
    ckpt = load_checkpoint(path, show_progress=False)
    return LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)


def hf_model(path):
    if path.is_file():  # GGUF: transformers dequantizes it itself
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def default_pair():
    path = resolve_model_path("default")
    return path, our_model(path), hf_model(path)


@pytest.fixture(scope="module", params=["gqa", "odd-heads-bias", "llama3-rope"])
def tiny_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gqa":
        save_tiny_llama(path)  # 4 heads over 2 KV heads, separate lm_head
    elif request.param == "llama3-rope":
        # Llama 3.1-style RoPE scaling; a short original context so the 100-token prompts feel it
        save_tiny_llama(
            path,
            seed=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    else:
        save_tiny_qwen2(path)  # 3 heads over 1 KV head, q/k/v bias, tied embeddings
    return path, our_model(path), hf_model(path)


def check_logits(pair, seed: int):
    path, ours, ref = pair
    vocab = ours.config.vocab_size
    for n in PROMPT_LENGTHS:
        ids = prompt_ids(n, vocab, seed + n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        got = paged_prefill_logits(ours, ids)
        diff = (got - expected).abs().max().item()
        assert diff < 1e-3, f"{path.name}: {n}-token prompt, max |logit diff| = {diff}"
        # the same logits when the prompt arrives in chunks over a cached prefix
        if n > 16:
            chunked = paged_prefill_logits(ours, ids, chunk=7)
            assert (chunked - expected).abs().max().item() < 1e-3


def test_default_model_logits_match_hf(default_pair):
    check_logits(default_pair, seed=0)


def test_tiny_models_logits_match_hf(tiny_pair):
    check_logits(tiny_pair, seed=1)


def greedy_hf(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


def check_prefill_logits(model, ref, lengths=(1, 17, 100), seed: int = 11) -> None:
    """`model` (ours, e.g. loaded from a GGUF of the same weights) against transformers' `ref`, fp32."""
    for n in lengths:
        ids = prompt_ids(n, model.config.vocab_size, seed + n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        assert (paged_prefill_logits(model, ids) - expected).abs().max().item() < 1e-3, n


def check_greedy_64(path, ref, vocab: int) -> LLM:
    """64 greedy tokens of LLM(path) in fp32 equal transformers' generate; returns the LLM."""
    llm = LLM(model=str(path), dtype="fp32", num_kv_blocks=64, show_progress=False)
    ids = prompt_ids(17, vocab, 5)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy_hf(ref, ids, 64)
    return llm


def check_tensor_parallel_2_equals_1(path, vocab: int) -> None:
    """16 greedy tokens of two prompts (5 and 40 tokens, chunked by 32) the same under TP=1 and TP=2."""
    ids = [prompt_ids(n, vocab, 20 + n) for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(model=str(path), dtype="fp32", tensor_parallel_size=tp, max_num_batched_tokens=32,
                  show_progress=False)  # fmt: skip
        outs.append([o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]


def test_default_model_greedy_64_tokens_match_hf(default_pair):
    path, _, ref = default_pair
    # the GGUF dequantized once, as HF loads it (quantization="auto" would serve its blocks natively)
    llm = LLM(model=str(path), dtype="fp32", quantization="none", num_kv_blocks=256, show_progress=False)
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy_hf(ref, tok.encode(prompt), 64), prompt


def test_tiny_model_greedy_64_tokens_match_hf(tiny_pair):
    path, ours, ref = tiny_pair
    llm = LLM(model=str(path), dtype="fp32", num_kv_blocks=64, show_progress=False)
    ids = prompt_ids(17, ours.config.vocab_size, 5)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy_hf(ref, ids, 64)
