import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from pagedllm import ops
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p,
    greedy,
    is_plain_greedy,
    sample,
    sample_requests,
)

V = 32


def batch_of(*rows, vocab_size=V, eos_token_ids=()):
    """rows: SamplingParams or (params, prompt, output, generator) tuples."""
    full = [r if isinstance(r, tuple) else (r, [], [], None) for r in rows]
    return SamplingBatch.from_rows(full, vocab_size, "cpu", eos_token_ids=eos_token_ids)


def rand_logits(b, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_skips_extras():
    logits = rand_logits(4)
    batch = batch_of(*[SamplingParams(temperature=0)] * 4)
    assert batch.all_greedy
    assert batch.top_k is batch.top_p is batch.min_p is batch.output_counts is batch.bias_index is None
    out = sample(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4 and out.sampled_logprobs == [None] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 33, 100, 49152, 49153])
def test_argmax_kernel_breaks_ties_and_nans_as_torch_max(dtype, vocab):
    kernel = ops.kernel("argmax")
    assert kernel is not None, "the C++ greedy kernel did not build"
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 3, (12, vocab), generator=gen).to(dtype)  # small integers: many ties
    x[1] = float("-inf")
    x[2, vocab // 2] = float("nan")  # a NaN wins, the first of them
    x[3, -1] = float("nan")
    x[4, 0] = float("nan")
    x[5, vocab // 3 :] = float("nan")
    x[6, -1] = 100.0  # the maximum in a row's tail
    x[7] = 0.0
    x[7, -1] = -0.0  # equal to 0.0: the first index
    expected = x.max(dim=-1).indices
    assert torch.equal(kernel.argmax_rows(x), expected)
    assert torch.equal(greedy(x), expected)


def test_greedy_batch_samples_bf16_logits_as_float32():
    # the runner hands bf16 logits over as they are; a plain greedy batch takes their argmax, any other
    # batch works on a float32 copy
    logits = rand_logits(4, v=1000).bfloat16()
    plain = batch_of(*[SamplingParams(temperature=0)] * 4, vocab_size=1000)
    assert plain.plain_greedy
    assert sample(logits, plain).token_ids == logits.float().argmax(-1).tolist()
    with_logprobs = batch_of(*[SamplingParams(temperature=0, logprobs=2)] * 4, vocab_size=1000)
    assert not with_logprobs.plain_greedy
    out = sample(logits, with_logprobs)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.sampled_logprobs[0] == pytest.approx(torch.log_softmax(logits.float()[0], -1).max().item())


def test_input_logits_not_modified():
    logits = rand_logits(2)
    before = logits.clone()
    p = SamplingParams(
        temperature=0.7,
        top_k=3,
        top_p=0.9,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logit_bias={1: 5.0},
        min_tokens=2,
        logprobs=2,
    )
    sample(logits, batch_of((p, [1, 2], [3], None), (p, [], [], None), eos_token_ids=[0]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=1, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=["top_k=1", "top_p tiny", "top_k=1+top_p", "min_p=1"],
)
def test_filters_that_leave_one_token_equal_greedy(params):
    logits = rand_logits(8, seed=1)
    torch.manual_seed(0)
    for _ in range(5):
        assert sample(logits, batch_of(*[params] * 8)).token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(4, seed=2)
    batch = batch_of(
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0),
    )
    assert not batch.all_greedy and not batch.all_random
    torch.manual_seed(0)
    out = sample(logits, batch).token_ids
    assert out[:3] == logits.argmax(-1).tolist()[:3]


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    # row 0: top-2; row 1: off (k = V)
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.equal(out[1], logits[1])
    # top-p: probs of [4, 3, 2, 1] are about [.64, .24, .09, .03]; p = 0.8 keeps the first two,
    # p = 0.9 keeps three (0.64 + 0.24 = 0.88 < 0.9).
    out = apply_top_k_top_p(logits, None, torch.tensor([0.8, 0.9]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.isinf(out[1]).tolist() == [True, False, False, False]
    # both: k = 2 first, then p over what is left
    out = apply_top_k_top_p(logits, torch.tensor([2, 3]), torch.tensor([0.5, 1.0]))
    assert torch.isinf(out[0]).tolist() == [True, False, True, True]
    assert torch.isinf(out[1]).tolist() == [True, False, False, False]


def test_top_p_keeps_the_best_token_despite_rounding():
    # float32 cumsum over a large vocabulary can end below 1 - p; the most likely token must survive.
    logits = torch.randn(4, 50000, generator=torch.Generator().manual_seed(0))
    out = apply_top_k_top_p(logits, None, torch.full((4,), 1e-7))
    assert (~torch.isinf(out)).sum(-1).tolist() == [1, 1, 1, 1]
    assert out.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_min_p_never_samples_below_threshold():
    # probs of [0, ln 0.5, ln 0.05, ln 0.3]-ish: min_p = 0.2 keeps tokens with prob >= 0.2 * max.
    probs = torch.tensor([0.5, 0.3, 0.05, 0.15])
    logits = probs.log().expand(2000, 4).contiguous()
    torch.manual_seed(0)
    toks = sample(logits, batch_of(*[SamplingParams(temperature=1.0, min_p=0.35)] * 2000)).token_ids
    assert set(toks) == {0, 1}  # 0.05 and 0.15 < 0.35 * 0.5
    freq1 = toks.count(1) / len(toks)
    assert abs(freq1 - 0.3 / 0.8) < 0.05  # renormalised over what is kept


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits / temperature, -1)
    n = 20000
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(4321)
    # n unseeded rows (global generator)
    rows = [(SamplingParams(temperature=temperature), [], [], None)] * n
    toks = sample(logits.expand(n, 6).contiguous(), SamplingBatch.from_rows(rows, 6)).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=6).double()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 25.0  # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4; a wrong temperature gives thousands
    # and n rows sharing one seeded generator
    rows = [(SamplingParams(temperature=temperature), [], [], gen)] * 2000
    toks = sample(logits.expand(2000, 6).contiguous(), SamplingBatch.from_rows(rows, 6)).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=6).double()
    chi2 = (((counts - 2000 * expected) ** 2) / (2000 * expected)).sum().item()
    assert chi2 < 25.0


def test_seeded_rows_independent_of_batch_mates_and_order():
    V2 = 1000
    base = rand_logits(1, V2, seed=5)[0] / 3  # fairly flat: many likely tokens
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def run(position, others, steps=6):
        gen = torch.Generator().manual_seed(7)
        toks = []
        for _ in range(steps):
            rows = [(SamplingParams(temperature=0.8), [], [], None)] * others
            rows.insert(position, (seeded, [], [], gen))
            logits = torch.cat([rand_logits(others + 1, V2, seed=len(toks) + 100)])
            logits[position] = base
            toks.append(sample(logits, SamplingBatch.from_rows(rows, V2)).token_ids[position])
        return toks

    torch.manual_seed(0)
    alone = run(0, 0)
    torch.manual_seed(1)
    assert run(0, 5) == alone
    torch.manual_seed(2)
    assert run(3, 5) == alone
    torch.manual_seed(3)
    assert run(7, 7) == alone
    assert len(set(alone)) > 1  # it really samples
    # a different seed gives a different sequence
    gen = torch.Generator().manual_seed(8)
    other = [
        sample(base[None], SamplingBatch.from_rows([(seeded, [], [], gen)], V2)).token_ids[0]
        for _ in range(6)
    ]
    assert other != alone


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # prompt has 0 and 1, output has 2 and 3 (twice): all four penalised once; 4 and 5 untouched
    batch = batch_of((p, [0, 1], [2, 3, 3], None), vocab_size=6)
    out = apply_penalties(logits, batch)
    assert out.tolist() == [[1.0, -4.0, 0.5, -2.0, 3.0, 0.5]]


def test_presence_and_frequency_penalties_output_only():
    logits = torch.zeros(1, 6)
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    batch = batch_of((p, [4, 4, 5], [1, 2, 2, 2], None), vocab_size=6)
    out = apply_penalties(logits, batch)
    # token 1: -0.5 - 0.25; token 2: -0.5 - 3 * 0.25; prompt tokens 4, 5 untouched
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0, 0.0]]
    assert batch.prompt_mask is None  # prompt only matters for repetition_penalty


def test_penalties_only_on_rows_that_ask():
    logits = torch.ones(2, 4)
    batch = batch_of(
        (SamplingParams(temperature=0, frequency_penalty=1.0), [], [0, 0], None),
        (SamplingParams(temperature=0), [], [0, 0], None),
        vocab_size=4,
    )
    assert apply_penalties(logits, batch).tolist() == [[-1.0, 1.0, 1.0, 1.0], [1.0] * 4]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sample(logits, batch_of((p, [], [0], None), vocab_size=3)).token_ids == [1]
    assert sample(logits, batch_of((p, [], [1], None), vocab_size=3)).token_ids == [0]


def test_logit_bias():
    logits = torch.zeros(2, 5)
    logits[:, 0] = 1.0
    batch = batch_of(
        SamplingParams(temperature=0, logit_bias={3: 2.5, 99: 100.0}),  # 99 out of vocab: ignored
        SamplingParams(temperature=0, logit_bias={0: -100.0, 4: 0.5}),
        vocab_size=5,
    )
    assert sample(logits, batch).token_ids == [3, 4]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, 6)
    logits[:, 5] = 10.0  # EOS
    logits[:, 4] = 9.0  # a stop token id
    logits[:, 2] = 8.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    batch = batch_of(
        (p, [1], [], None),  # 0 < 2: both masked
        (p, [1], [2], None),  # 1 < 2: still masked
        (p, [1], [2, 2], None),  # done: EOS allowed again
        vocab_size=6,
        eos_token_ids=[5],
    )
    assert sample(logits, batch).token_ids == [2, 2, 5]
    # ignore_eos is a stop-check matter: the sampler masks EOS the same way
    q = SamplingParams(temperature=0, min_tokens=1, ignore_eos=True)
    assert sample(logits[:1], batch_of((q, [], [], None), vocab_size=6, eos_token_ids=[5])).token_ids == [4]


def test_from_requests_uses_each_rows_eos_ids():
    class Req:  # duck-typed core.request.Request
        def __init__(self, eos, output):
            self.sampling_params = SamplingParams(temperature=0, min_tokens=1)
            self.prompt_token_ids, self.output_token_ids, self.generator = [1], output, None
            self.eos_token_ids = eos

    logits = torch.zeros(3, 6)
    logits[:, 5], logits[:, 4], logits[:, 3] = 10.0, 9.0, 8.0
    batch = SamplingBatch.from_requests([Req([5], []), Req([5, 4], []), Req([5, 4], [3])], 6)
    assert sample(logits, batch).token_ids == [4, 3, 5]


def test_logprobs_from_raw_logits():
    logits = rand_logits(3, seed=9)
    p_lp = SamplingParams(temperature=0, logprobs=5, repetition_penalty=1.5, logit_bias={0: 50.0})
    batch = batch_of(
        (p_lp, [1, 2], [3], None),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, logprobs=0),
    )
    torch.manual_seed(0)
    out = sample(logits, batch)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None and out.sampled_logprobs[1] is None and out.sampled_ranks[1] is None
    top = out.logprobs[0]
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    ref_vals, ref_ids = raw[0].topk(5)
    assert [t for t, _ in top] == ref_ids.tolist()
    for t, lp in top:
        assert math.isclose(lp, raw[0, t].item(), rel_tol=1e-6)
    # logit_bias made token 0 win, but its logprob and rank come from the raw logits
    assert out.token_ids[0] == 0
    assert math.isclose(out.sampled_logprobs[0], raw[0, 0].item(), rel_tol=1e-6)
    assert out.sampled_ranks[0] == int((raw[0] > raw[0, 0]).sum()) + 1
    # logprobs=0: no top list, but the sampled token's logprob and rank
    assert out.logprobs[2] == []
    t2 = out.token_ids[2]
    assert math.isclose(out.sampled_logprobs[2], raw[2, t2].item(), rel_tol=1e-6)
    assert out.sampled_ranks[2] == int((raw[2] > raw[2, t2]).sum()) + 1


def test_greedy_rank_is_one():
    logits = rand_logits(2, seed=3)
    out = sample(logits, batch_of(*[SamplingParams(temperature=0, logprobs=1)] * 2))
    assert out.sampled_ranks == [1, 1]
    assert [lp[0][0] for lp in out.logprobs] == out.token_ids


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 1e-6, 0.5, 1.0]),
    logprobs=st.sampled_from([None, 0, 2]),
    logit_bias=st.sampled_from([None, {}, {3: 1.0}]),
    min_tokens=st.integers(0, 3),
    num_output=st.integers(0, 4),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -0.5]),
    top_k=st.sampled_from([0, 5]),
)
def test_a_plain_greedy_row_is_what_makes_a_plain_greedy_batch(
    temperature, logprobs, logit_bias, min_tokens, num_output, **rest
):
    # the model runner skips building the batch when every row is_plain_greedy: that must be exactly
    # when the batch would have been plain_greedy (EOS in the vocabulary, bias on in-vocabulary tokens)
    p = SamplingParams(
        temperature=temperature, logprobs=logprobs, logit_bias=logit_bias, min_tokens=min_tokens, **rest
    )
    row = (p, [1, 2], [5] * num_output, None)
    batch = SamplingBatch.from_rows([row, row], V, "cpu", eos_token_ids=[0])
    assert is_plain_greedy(p, num_output) == batch.plain_greedy


def test_sample_requests_takes_the_argmax_only_when_every_row_is_plain_greedy():
    from types import SimpleNamespace

    def req(params, output=()):
        return SimpleNamespace(
            sampling_params=params,
            prompt_token_ids=[1],
            output_token_ids=list(output),
            generator=None,
            eos_token_ids=[0],
        )

    logits = rand_logits(3).bfloat16()
    plain = [req(SamplingParams(temperature=0))] * 3
    out = sample_requests(logits, plain)
    assert out.token_ids == logits.float().argmax(-1).tolist() and out.sampled_logprobs == [None] * 3
    # one row asking for logprobs: the whole batch goes through sample(), which reports them
    mixed = plain[:2] + [req(SamplingParams(temperature=0, logprobs=1))]
    out = sample_requests(logits, mixed)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.sampled_logprobs[:2] == [None, None] and out.sampled_logprobs[2] is not None
    # min_tokens not yet reached bans EOS (token 0): it must not be picked even where it is the maximum
    lifted = logits.clone()
    lifted[:, 0] = 100
    banned = [req(SamplingParams(temperature=0, min_tokens=2), output=[5])] * 3
    assert 0 not in sample_requests(lifted, banned).token_ids


def test_output_kind_must_be_a_request_output_kind():
    from pagedllm.errors import InputError
    from pagedllm.sampling_params import RequestOutputKind

    assert (
        SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind is RequestOutputKind.FINAL_ONLY
    )
    with pytest.raises(InputError, match="RequestOutputKind.FINAL_ONLY") as e:
        SamplingParams(output_kind="final")
    assert e.value.param == "output_kind"
