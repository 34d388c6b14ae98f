"""Sliding-window attention in the paged cache: a random Mistral (a 20-token window on every layer) and a
Qwen2 whose windowed and global layers mix, against transformers; blocks wholly before every layer's
window go back to the pool as a request moves on (the KV manager's counts, asserted step by step), and
prefix sharing, preemption, forks, chunked prefill and speculative decoding keep the output exact."""

from __future__ import annotations

import pytest
from test_model_families import our_model
from test_model_vs_hf import check_logits, greedy_hf, hf_model, prompt_ids
from tiny_models import TINY_MISTRAL, save_tiny_mistral, save_tiny_qwen2

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import NULL_BLOCK_ID, cdiv

WINDOW = TINY_MISTRAL["sliding_window"]
BS = 16


@pytest.fixture(scope="module")
def mistral_pair(tmp_path_factory):
    path = save_tiny_mistral(tmp_path_factory.mktemp("mistral"), seed=3)
    return path, our_model(path), hf_model(path)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def mistral_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="fp32", show_progress=False, **kwargs)


def test_mistral_config_windows_every_layer(mistral_pair):
    _, ours, _ = mistral_pair
    c = ours.config
    assert c.sliding_window == WINDOW and c.all_layers_sliding and c.max_position_embeddings == 512
    assert all(layer.self_attn.sliding_window == WINDOW for layer in ours.model.layers)


def test_mistral_logits_match_hf(mistral_pair):
    check_logits(mistral_pair, seed=4)  # 100-token prompts: five windows long; chunked over a cached prefix


def test_mistral_greedy_equals_hf_and_frees_blocks_behind_the_window(mistral_pair):
    path, ours, ref = mistral_pair
    llm = mistral_llm(path, num_kv_blocks=64)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    ids = prompt_ids(50, ours.config.vocab_size, 7)
    engine.add_request("r", ids, greedy(80))
    tokens: list[int] = []
    held_most, computed_when_scheduled = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        req = engine.scheduler.requests.get("r")
        if req is None:  # finished this step
            continue
        # the step's allocation gave back every block before the window of its first query, and keeps
        # every block the next query reads
        gone = max(0, computed_when_scheduled - WINDOW + 1) // BS
        needed = max(0, req.num_computed_tokens - WINDOW + 1) // BS
        table = req.block_ids
        assert all(b == NULL_BLOCK_ID for b in table[:gone]), (computed_when_scheduled, table)
        assert all(b != NULL_BLOCK_ID for b in table[needed:]), (req.num_computed_tokens, table)
        computed_when_scheduled = req.num_computed_tokens
        held = kv.num_held_blocks(req)
        assert held == kv.num_blocks - kv.num_free_blocks  # it is the only request
        held_most = max(held_most, held)
    # 130 tokens would hold 9 blocks; the window never needs more than 3 (plus the one being filled)
    assert held_most <= cdiv(WINDOW, BS) + 2 < cdiv(50 + 80, BS)
    assert kv.num_free_blocks == kv.num_blocks
    assert tokens == greedy_hf(ref, ids, 80)


def test_mistral_batch_prefix_sharing_preemption_and_forks_stay_exact(mistral_pair):
    """A shared 40-token prefix (longer than the window), chunked prefill, a pool small enough to preempt,
    and an n=2 fork: every output equals the same prompt run alone."""
    path, ours, _ = mistral_pair
    vocab = ours.config.vocab_size
    shared = prompt_ids(40, vocab, 1)
    prompts = [shared + prompt_ids(n, vocab, 10 + n) for n in (3, 9, 17)] + [prompt_ids(30, vocab, 2)]
    alone = mistral_llm(path, num_kv_blocks=64)
    want = [alone.generate([p], greedy(60), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    # 8 blocks hold 128 tokens; four 100-117-token requests fit only because the window frees blocks,
    # and not all at once: someone is preempted
    tight = mistral_llm(path, num_kv_blocks=8, max_num_batched_tokens=24, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(60), use_tqdm=False)]
    assert got == want
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks_total
    fork = SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)
    outs = tight.generate([prompts[1]], fork, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [want[1], want[1]]
    assert tight.llm_engine.get_stats().num_free_blocks == stats.num_blocks_total


def test_mistral_speculative_decoding_over_freed_blocks(mistral_pair):
    """Drafts verified as decode rows over a windowed table (the model drafting for itself, so most hold
    and the runs cross block and window boundaries): the same tokens as plain decoding."""
    path, ours, _ = mistral_pair
    ids = [prompt_ids(n, ours.config.vocab_size, n) for n in (5, 45)]
    plain = mistral_llm(path, num_kv_blocks=64).generate(ids, greedy(60), use_tqdm=False)
    config = {"model": str(path), "num_speculative_tokens": 4, "draft_budget": "off"}
    spec = mistral_llm(path, num_kv_blocks=64, speculative_config=config)
    got = spec.generate(ids, greedy(60), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode.acceptance_rate > 0.9 and stats.num_free_blocks == stats.num_blocks_total


def test_mixed_window_and_global_layers_keep_every_block(tmp_path):
    """Qwen2 with use_sliding_window from layer 1 on: layer 0 is global, so it still reads every block and
    none is freed; the windowed layers attend to the window only, as in transformers."""
    path = save_tiny_qwen2(tmp_path / "qwen2", seed=5, use_sliding_window=True, sliding_window=20,
                           max_window_layers=1)  # fmt: skip
    ours, ref = our_model(path), hf_model(path)
    assert ours.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert not ours.config.all_layers_sliding
    check_logits((path, ours, ref), seed=6)
    llm = mistral_llm(path, num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.scheduler.kv_cache_manager.sliding_window is None
    ids = prompt_ids(40, ours.config.vocab_size, 3)
    out = llm.generate([ids], greedy(64), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy_hf(ref, ids, 64)


def test_window_wider_than_the_context_is_plain_attention(tmp_path):
    path = save_tiny_mistral(tmp_path / "m", sliding_window=4096)  # max_position_embeddings is 512
    c = our_model(path).config
    assert c.sliding_window is None and c.layer_types is None

