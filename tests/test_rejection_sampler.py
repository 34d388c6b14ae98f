"""Rejection sampling of draft tokens leaves the target distribution unchanged; prompt-lookup proposals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.worker import rejection_sampler
from pagedllm.worker.rejection_sampler import rejection_sample
from pagedllm.worker.sampler import SamplingBatch

V = 6


def test_ngram_takes_the_latest_earlier_occurrence_of_the_longest_suffix():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 (then 9, 9) and at 5 (then 7, 7, 5): the latest wins
    assert propose_ngram(seq, 3, 2, 3) == [7, 7, 5]
    assert propose_ngram(seq, 10, 2, 3) == [7, 7, 5, 1, 2, 3]  # runs to the end of the sequence
    assert propose_ngram([4, 5, 6, 7], 3, 1, 3) == []  # no suffix repeats
    assert propose_ngram([4, 5, 4], 2, 1, 3) == [5, 4]  # only the 1-gram [4] repeats
    assert propose_ngram([4, 5, 4], 2, 2, 3) == []  # ... below prompt_lookup_min
    assert propose_ngram([1, 1, 1, 1], 2, 2, 2) == [1]  # [1, 1] at 1 is the latest before the suffix
    assert propose_ngram([3], 4, 1, 2) == []


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "model": "default"}, "model"),
        ({"method": "ngram", "quantization": "gguf"}, "quantization"),
        ({"method": "ngram", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ("{not json", None),
        ("[1]", None),
    ],
)
def test_speculative_config_refuses_what_it_does_not_do_naming_the_field(value, field):
    with pytest.raises(InputError) as e:
        SpeculativeConfig.parse(value)
    assert e.value.param == ("speculative_config" if field is None else f"speculative_config.{field}")


def test_speculative_config_from_json_and_inferred_method():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram",
        3,
        2,
        4,
    )
    assert SpeculativeConfig.parse({"model": "default"}).method == "draft_model"


def _batch(params: SamplingParams, drafts: list[int], generator=None) -> SamplingBatch:
    rows = [(params, [0], drafts[:j], generator) for j in range(len(drafts) + 1)]
    return SamplingBatch.from_rows(rows, V)


def test_greedy_accepts_while_the_argmax_agrees():
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([2, 3, 1, 5]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    (run,) = rejection_sample(logits, _batch(greedy, [2, 3, 4]), [(0, [2, 3, 4])], [None])
    assert run.token_ids == [2, 3, 1] and run.num_accepted == 2  # draft 4 fails where the argmax is 1
    (run,) = rejection_sample(logits, _batch(greedy, [2, 3, 1]), [(0, [2, 3, 1])], [None])
    assert run.token_ids == [2, 3, 1, 5]  # all held: the bonus token from the last row


TARGET = torch.tensor(
    [[0.05, 0.4, 0.3, 0.15, 0.1, 0.0], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]]
)


def _draws(n: int, drafts: list[int], seed: int = 0) -> np.ndarray:
    """n verifications of `drafts` against TARGET's two rows at temperature 1, as n requests of one batch
    (each its own seeded generator): the first two tokens emitted (the second -1 where the first draft
    was rejected)."""
    params = SamplingParams(temperature=1.0, seed=0)
    rows = [(params, [0], drafts[:j], None) for _ in range(n) for j in range(len(drafts) + 1)]
    batch = SamplingBatch.from_rows(rows, V)
    logits = TARGET.log().clamp(min=-1e4)[: len(drafts) + 1].repeat(n, 1)
    gens = [torch.Generator().manual_seed(seed * n + i) for i in range(n)]
    spans = [(i * (len(drafts) + 1), drafts) for i in range(n)]
    runs = rejection_sample(logits, batch, spans, gens)
    return np.array([(r.token_ids + [-1])[:2] for r in runs], dtype=np.int64)


def _counts(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=V)


@pytest.mark.parametrize("draft", [1, 3, 5])  # likely, unlikely, impossible under TARGET's first row
def test_the_first_token_follows_the_target_whatever_the_draft(draft):
    n = 4000
    first = _draws(n, [draft])[:, 0]
    expected = TARGET[0].numpy() * n
    observed = _counts(first)
    assert observed[5] == 0  # probability 0: never emitted, even proposed
    seen = expected > 0
    chi2 = (((observed - expected) ** 2)[seen] / expected[seen]).sum()
    assert chi2 < 20.5, (observed, expected)  # p = 0.0004 at 4 degrees of freedom


def test_a_broken_acceptance_rule_fails_the_same_bound(monkeypatch):
    """The bound is not vacuous: resampling from p instead of the residual after a rejection (a classic
    bug) over-weights the draft token, and the test above catches it."""
    original = rejection_sampler.exponential_race

    def race_without_residual(p, gens):
        return original(TARGET[:1].repeat(p.shape[0], 1).clone(), gens)

    monkeypatch.setattr(rejection_sampler, "exponential_race", race_without_residual)
    n = 4000
    observed = _counts(_draws(n, [1])[:, 0])
    expected = TARGET[0].numpy() * n
    seen = expected > 0
    assert (((observed - expected) ** 2)[seen] / expected[seen]).sum() > 100


def test_the_bonus_position_follows_the_target_given_an_accepted_draft():
    n = 4000
    draws = _draws(n, [2, 4])  # draft 2 is accepted 30% of the time; then row 1 decides
    second = draws[draws[:, 1] >= 0, 1]
    assert 0.2 * n < len(second) < 0.4 * n
    # given the first draft held, the second token is TARGET[1]: chi-square of independence-free fit
    expected = TARGET[1].numpy() * len(second)
    observed = _counts(second)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 20.5, (observed, expected)


def test_seeded_verification_is_reproducible():
    a = _draws(50, [1, 2], seed=7)
    b = _draws(50, [1, 2], seed=7)
    assert (a == b).all()
    assert len({tuple(x) for x in a}) > 3  # it samples


def test_draft_budget_takes_rows_while_they_pay():
    from pagedllm.spec_decode.budget import AcceptanceTracker, StepCost, allot_drafts

    cost = StepCost.linear(fixed=7e-3, per_row=3.7e-3)  # about the default model on 2 AVX2 cores
    # one request copying its prompt: every guess pays
    assert allot_drafts({"a": 0.95}, {"a": 4}, 1, cost) == {"a": 4}
    # a coin-flip guesser alone: the first draft pays (0.5 x 10.7 ms > 1 x 3.7 ms), the second does not
    # (0.25 x 14.4 ms < 1.5 x 3.7 ms)
    assert allot_drafts({"a": 0.5}, {"a": 4}, 1, cost) == {"a": 1}
    # 32 requests already compute-bound: only near-certain guesses are worth a row
    rates = {f"r{i}": 0.5 if i % 2 else 0.99 for i in range(32)}
    got = allot_drafts(rates, dict.fromkeys(rates, 4), 32, cost)
    assert all(got[r] == 0 for r in rates if rates[r] == 0.5)
    assert all(got[r] > 0 for r in rates if rates[r] == 0.99)
    # the tracker: a request whose guesses keep failing falls below the prior, one that holds rises
    t = AcceptanceTracker()
    prior = t.rate("new")
    for _ in range(5):
        t.observe("bad", 4, 0)
        t.observe("good", 4, 4)
    assert t.rate("bad") < 0.4 < prior < t.rate("good")
    t.retain({"good"})
    assert t.rate("bad") == t.rate("unseen")


def test_step_cost_interpolates_its_measured_points():
    from pagedllm.spec_decode.budget import StepCost

    cost = StepCost((1, 2, 4, 16), (0.010, 0.020, 0.024, 0.060))
    assert cost(1) == 0.010 and cost(3) == pytest.approx(0.022) and cost(16) == pytest.approx(0.060)
    assert cost(20) == pytest.approx(0.072)  # the last segment's 3 ms a row, on
    assert StepCost.linear(0.007, 0.003)(10) == pytest.approx(0.037)
