"""Rejection sampling of draft tokens: keep the target model's distribution exactly, at any temperature.

A request that speculates feeds its last token plus k draft tokens d_1..d_k; row j of its logits is the
target distribution p_j of the token after d_j (row 0: after the last known token). Draft j+1 is accepted
with probability min(1, p_j(d) / q_j(d)). Both proposers here propose deterministically (prompt lookup,
a draft model's argmax), so q_j is a point mass and the rule is: accept with probability p_j(d). At the
first rejection the token is drawn from the residual max(p_j - q_j, 0), which is p_j with d removed and
renormalized; when every draft holds, a bonus token is drawn from p_k. Every emitted token is then
distributed exactly as plain sampling would draw it (Leviathan et al. 2023, Chen et al. 2023). Greedy rows
reduce to: accept while the argmax agrees, then emit the argmax.

Each row sees the request's output extended by the drafts before it (SamplingBatch rows built that way),
so penalties, min_tokens and grammar masks apply per position as they would token by token. A seeded
request draws its uniforms and its final token from its own generator, in a fixed order, so the same
seed and drafts give the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.worker.sampler import (
    SamplingBatch,
    exponential_race,
    gather_logprobs,
    greedy,
    process_logits,
    random_probs,
)


@dataclass
class VerifiedRun:
    """One request's tokens of this step: the accepted drafts, then the token the target sampled."""

    token_ids: list[int]
    rows: list[int]  # the logits row each token came from
    num_draft_tokens: int
    logprobs: list[list[tuple[int, float]] | None]  # per token, as SamplerOutput's
    sampled_logprobs: list[float | None]
    sampled_ranks: list[int | None]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def rejection_sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    spans: Sequence[tuple[int, Sequence[int]]],
    generators: Sequence[torch.Generator | None],
) -> list[VerifiedRun]:
    """logits [R, V] straight from the model; batch: its R rows; spans: per request (first row, draft
    tokens), the request owning rows first .. first + len(drafts); generators: per request, its own
    (seeded) generator or None."""
    if batch.plain_greedy:
        return greedy_verify(greedy(logits).tolist(), spans)

    logits, raw_logprobs = process_logits(logits, batch)
    argmax = greedy(logits).tolist() if not batch.all_random else None
    probs = None
    if not batch.all_greedy:
        probs = random_probs(logits, batch, normalize=True)
    is_greedy = [True] * batch.num_rows if batch.all_greedy else [False] * batch.num_rows
    if batch.greedy_mask is not None:
        is_greedy = batch.greedy_mask.tolist()

    runs: list[tuple[list[int], int, bool]] = []  # (accepted drafts, final row, rejected there)
    for (first, drafts), gen in zip(spans, generators):
        if is_greedy[first]:
            run = _greedy_run(argmax, first, drafts)
            runs.append((run.token_ids[:-1], first + run.num_accepted, False))
            continue
        accepted = _accept_random(probs, first, drafts, gen)
        runs.append((list(drafts[:accepted]), first + accepted, accepted < len(drafts)))

    # One race over the final rows: each from p, or from the residual where its draft was rejected.
    random_finals = [i for i, (_, row, _) in enumerate(runs) if not is_greedy[row]]
    finals: dict[int, int] = {}
    if random_finals:
        rows = torch.tensor([runs[i][1] for i in random_finals], dtype=torch.long)
        p = probs.index_select(0, rows)
        for j, i in enumerate(random_finals):
            accepted, row, rejected = runs[i]
            if rejected:
                p[j, spans[i][1][len(accepted)]] = 0.0  # the residual max(p - q, 0) of a point mass q
        race_gens = {j: generators[i] for j, i in enumerate(random_finals) if generators[i] is not None}
        finals = dict(zip(random_finals, exponential_race(p, race_gens).tolist()))

    out: list[VerifiedRun] = []
    for i, ((first, drafts), (accepted, row, _)) in enumerate(zip(spans, runs)):
        final = finals[i] if i in finals else argmax[row]
        out.append(_run(accepted + [final], first, len(drafts)))
    if raw_logprobs is not None:
        _add_logprobs(out, raw_logprobs, batch)
    return out


def greedy_verify(argmax: list[int], spans: Sequence[tuple[int, Sequence[int]]]) -> list[VerifiedRun]:
    """Greedy rows only: each request's drafts held while the argmax agrees, then the argmax."""
    return [_greedy_run(argmax, first, drafts) for first, drafts in spans]


def _greedy_run(argmax: list[int], first: int, drafts: Sequence[int]) -> VerifiedRun:
    n = 0
    while n < len(drafts) and argmax[first + n] == drafts[n]:
        n += 1
    return _run(list(drafts[:n]) + [argmax[first + n]], first, len(drafts))


def _accept_random(
    probs: torch.Tensor, first: int, drafts: Sequence[int], gen: torch.Generator | None
) -> int:
    """How many leading drafts hold: draft j with probability p_j(d_j), one uniform each."""
    if not drafts:
        return 0
    k = len(drafts)
    p_draft = probs[torch.arange(first, first + k), torch.tensor(list(drafts))].tolist()
    uniforms = torch.rand(k, generator=gen).tolist()
    n = 0
    while n < k and uniforms[n] < p_draft[n]:
        n += 1
    return n


def _run(tokens: list[int], first: int, num_drafts: int) -> VerifiedRun:
    n = len(tokens)
    return VerifiedRun(tokens, list(range(first, first + n)), num_drafts, [None] * n, [None] * n, [None] * n)


def _add_logprobs(runs: list[VerifiedRun], raw_logprobs: torch.Tensor, batch: SamplingBatch) -> None:
    """The target's logprobs of each emitted token, from the row it was emitted at."""
    emitted = torch.zeros(batch.num_rows, dtype=torch.long)
    for run in runs:
        emitted[run.rows] = torch.tensor(run.token_ids)
    out = gather_logprobs(raw_logprobs, emitted, emitted.tolist(), batch)
    for run in runs:
        run.logprobs = [out.logprobs[r] for r in run.rows]
        run.sampled_logprobs = [out.sampled_logprobs[r] for r in run.rows]
        run.sampled_ranks = [out.sampled_ranks[r] for r in run.rows]
