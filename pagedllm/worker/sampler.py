"""Sampler: one batch of logits [B, V] -> one token per row, each row with its own SamplingParams.

Order (vLLM v1's, except that min-p comes last as in HF): the grammar bitmask of constrained rows ->
logprobs of those logits -> logit_bias ->
min_tokens -> repetition / presence / frequency penalties -> greedy rows take the argmax; the others:
temperature -> top-k -> top-p -> min-p -> exponential race (a seeded row draws its noise from its own
generator, so its tokens do not depend on whatever else shares the batch).

SamplingBatch is built once per step from plain Python rows; every optional part is None when no row in the
batch asked for it, so an all-greedy batch without extras costs one argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pagedllm import ops
from pagedllm.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them would overflow float32 (vLLM does the same).
_SAMPLING_EPS = 1e-5

# (params, prompt_token_ids, output_token_ids, generator or None[, eos_token_ids of this row])
SamplingRow = (
    tuple[SamplingParams, Sequence[int], Sequence[int], "torch.Generator | None"]
    | tuple[SamplingParams, Sequence[int], Sequence[int], "torch.Generator | None", Sequence[int]]
)


@dataclass
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows (never divides by 0)
    greedy_mask: torch.Tensor | None  # [B] bool, None when all rows agree (all_greedy or all_random)
    top_k: torch.Tensor | None  # [B] long, vocab_size = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off
    # Penalties: per-row factors plus token statistics, only built when a row has a penalty.
    repetition_penalty: torch.Tensor | None  # [B] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt (repetition penalty only)
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    # Sparse (row, token) edits flattened over the batch.
    bias_index: tuple[torch.Tensor, torch.Tensor] | None
    bias_value: torch.Tensor | None
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # min_tokens: EOS / stop_token_ids -> -inf
    generators: dict[int, torch.Generator]  # row -> its own generator (seeded rows)
    num_logprobs: list[int | None]  # per row; None = not asked for
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # Structured outputs: the constrained rows and their llguidance bitmasks ([R, ceil(V / 32)] int32,
    # bit t of a row allowing token t); None when no row is constrained.
    bitmask_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, and nothing but the argmax to take: no logprobs, logit edits or penalties."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.bias_index is None
            and self.ban_index is None
            and self.repetition_penalty is None
            and self.presence_penalty is None
            and self.token_bitmask is None
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        token_bitmask: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """rows: (params, prompt_token_ids, output_token_ids, generator[, eos_token_ids]) per row; a
        generator (seeded rows only) must live on `device`. EOS ids (the row's own, else eos_token_ids)
        are banned together with the row's stop_token_ids while len(output) < min_tokens.
        token_bitmask: (row indices, their bitmasks) for the rows a grammar constrains."""
        B, V = len(rows), vocab_size
        params = [r[0] for r in rows]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        greedy_mask = None if all_greedy or all_random else torch.tensor(greedy, device=device)

        # top-k / top-p / min-p only matter on random rows.
        rand = [p for p, g in zip(params, greedy) if not g]
        top_k = top_p = min_p = None
        if any(0 < p.top_k < V for p in rand):
            top_k = torch.tensor(
                [p.top_k if 0 < p.top_k < V and not g else V for p, g in zip(params, greedy)],
                dtype=torch.long,
                device=device,
            )
        if any(p.top_p < 1.0 for p in rand):
            top_p = f32([1.0 if g else p.top_p for p, g in zip(params, greedy)])
        if any(p.min_p > 0.0 for p in rand):
            min_p = f32([0.0 if g else p.min_p for p, g in zip(params, greedy)])

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        pf_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        repetition_penalty = prompt_mask = presence_penalty = frequency_penalty = output_counts = None
        if rep_rows or pf_rows:
            # Output counts feed all three penalties; a loop over the rows that have a penalty is fine.
            counted = sorted(set(rep_rows) | set(pf_rows))
            output_counts = _token_counts(B, V, [(i, rows[i][2]) for i in counted], device)
        if rep_rows:
            repetition_penalty = f32([p.repetition_penalty for p in params])
            prompt_mask = _token_counts(B, V, [(i, rows[i][1]) for i in rep_rows], device) > 0
        if pf_rows:
            presence_penalty = f32([p.presence_penalty for p in params])
            frequency_penalty = f32([p.frequency_penalty for p in params])

        # Out-of-vocab ids are dropped here rather than failing the whole batch; the engine validates input.
        bias = [(i, int(t), float(b)) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        bias = [x for x in bias if 0 <= x[1] < V]
        bias_index = bias_value = None
        if bias:
            r, t, b = zip(*bias)
            bias_index = (_long(r, device), _long(t, device))
            bias_value = f32(list(b))

        ban = [
            (i, t)
            for i, (p, row) in enumerate(zip(params, rows))
            if len(row[2]) < p.min_tokens
            for t in {*(row[4] if len(row) > 4 else eos_token_ids), *p.stop_token_ids}
            if 0 <= t < V
        ]
        ban_index = None
        if ban:
            r, t = zip(*ban)
            ban_index = (_long(r, device), _long(t, device))

        generators = {i: r[3] for i, r in enumerate(rows) if r[3] is not None and not greedy[i]}
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            num_rows=B,
            vocab_size=V,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            greedy_mask=greedy_mask,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            prompt_mask=prompt_mask,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            output_counts=output_counts,
            bias_index=bias_index,
            bias_value=bias_value,
            ban_index=ban_index,
            generators=generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            bitmask_rows=None if token_bitmask is None else _long(list(token_bitmask[0]), device),
            token_bitmask=None if token_bitmask is None else token_bitmask[1].to(device),
        )

    @classmethod
    def from_requests(
        cls,
        requests: Sequence,
        vocab_size: int,
        device: torch.device | str = "cpu",
        token_bitmask: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """From core Requests (duck-typed: sampling_params, prompt_token_ids, output_token_ids, generator,
        eos_token_ids), one row each, in order."""
        rows = [
            (r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator, r.eos_token_ids)
            for r in requests
        ]
        return cls.from_rows(rows, vocab_size, device, token_bitmask=token_bitmask)


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether this row, in any batch, leaves the sampler nothing but the argmax of its raw logits: greedy,
    no logprobs, no logit bias, no penalty, and past min_tokens (nothing banned). A batch whose rows all
    are is SamplingBatch.plain_greedy, so the model runner can skip building the batch."""
    return (
        params.temperature < _SAMPLING_EPS
        and params.logprobs is None
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, only for rows that asked for logprobs (else None); all from the raw model logits.
    logprobs: list[list[tuple[int, float]] | None]  # top-N (token, logprob), most likely first
    sampled_logprobs: list[float | None]
    sampled_ranks: list[int | None]  # 1 = the sampled token was the most likely one


def sample_requests(
    logits: torch.Tensor,
    requests: Sequence,
    token_bitmask: tuple[Sequence[int], torch.Tensor] | None = None,
) -> SamplerOutput:
    """One token for each of `requests` (core Requests, one logits row each, in order); token_bitmask:
    (row indices, bitmasks) of the rows a grammar constrains. When every row is_plain_greedy and none is
    constrained, the argmax of the raw logits, without building a SamplingBatch (~0.15-0.3 ms of a
    32-row step); else sample() over the batch."""
    if token_bitmask is None and all(
        is_plain_greedy(r.sampling_params, len(r.output_token_ids)) for r in requests
    ):
        return _greedy_output(logits)
    return sample(
        logits, SamplingBatch.from_requests(requests, logits.shape[-1], token_bitmask=token_bitmask)
    )


def _greedy_output(logits: torch.Tensor) -> SamplerOutput:
    B = logits.shape[0]
    return SamplerOutput(greedy(logits).tolist(), [None] * B, [None] * B, [None] * B)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum, a NaN counting as the maximum (as torch.max(dim) breaks
    ties and NaNs). On CPU the C++ kernel reads [32, 49152] bf16 logits in a fraction of ATen's max(dim)
    (~0.57 ms on 2 threads; argmax ~2.6 ms); elsewhere max(dim)."""
    kernel = ops.kernel("argmax") if logits.device.type == "cpu" else None
    if kernel is not None and logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(-1) == 1:
        return kernel.argmax_rows(logits)
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [B, V] straight from the model (not modified), in its dtype: a greedy batch without
    logprobs, logit edits or penalties takes the argmax of them as they are (a bf16 -> float32 copy
    changes no value and no order); everything else works on float32."""
    if batch.plain_greedy:
        return _greedy_output(logits)
    logits, raw_logprobs = process_logits(logits, batch)

    if batch.all_greedy:
        sampled = greedy(logits)
    else:
        random_sampled = sample_random(logits, batch)
        if batch.all_random:
            sampled = random_sampled
        else:
            sampled = torch.where(batch.greedy_mask, greedy(logits), random_sampled)

    token_ids = sampled.tolist()
    if raw_logprobs is None:
        B = batch.num_rows
        return SamplerOutput(token_ids, [None] * B, [None] * B, [None] * B)
    return gather_logprobs(raw_logprobs, sampled, token_ids, batch)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits after the grammar bitmask, logit_bias, min_tokens and the penalties; and the
    log-softmax taken after the bitmask (the logprobs a row reports), None when no row asked for them."""
    logits = logits.float()
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.bitmask_rows, batch.token_bitmask)
    raw_logprobs = None
    if batch.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = apply_logit_edits(logits, batch)
    return apply_penalties(logits, batch), raw_logprobs


_BIT = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf on every token a row's grammar forbids: bitmask [R, ceil(V / 32)] int32 unpacked to [R, V] bools
    in one shift-and-mask over the rows (no loop over rows or tokens). A mask that allows nothing (a
    matcher in its error state) is left off rather than turning the row into NaNs."""
    V = logits.shape[-1]
    allowed = ((bitmask[:, :, None] >> _BIT.to(bitmask.device)) & 1).view(bitmask.shape[0], -1)[:, :V].bool()
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_logit_edits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, then min_tokens (EOS / stop tokens banned until the row has generated min_tokens)."""
    if batch.bias_index is not None:
        logits = logits.index_put(batch.bias_index, batch.bias_value, accumulate=True)
    if batch.ban_index is not None:
        logits = logits.index_put(batch.ban_index, logits.new_tensor(float("-inf")))
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    counts = batch.output_counts
    if batch.repetition_penalty is not None:
        # HF semantics over prompt + output tokens: shrink towards 0 from either side.
        seen = batch.prompt_mask | (counts > 0)
        penalty = torch.where(seen, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.presence_penalty is not None:
        # OpenAI semantics over output tokens only.
        logits = logits - batch.frequency_penalty[:, None] * counts
        logits = logits - batch.presence_penalty[:, None] * (counts > 0)
    return logits


def sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return exponential_race(random_probs(logits, batch), batch.generators)


def random_probs(logits: torch.Tensor, batch: SamplingBatch, normalize: bool = False) -> torch.Tensor:
    """The distribution a random row samples from: temperature -> top-k -> top-p -> min-p. Unnormalized
    after min-p (the race does not care) unless normalize: rejection sampling compares probabilities."""
    logits = logits / batch.temperature[:, None]
    logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        # Keep tokens at least min_p times as likely as the best one (renormalising does not change the ratio).
        keep = probs >= batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        if normalize:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k and top-p. k = V or p = 1.0 leaves a row alone."""
    if k is None and p is None:
        return logits
    V = logits.shape[-1]
    if p is None:
        # top-k only: topk(max k) is much cheaper than sorting the whole vocabulary.
        off = k >= V
        k_eff = torch.where(off, 1, k)
        top = logits.topk(int(k_eff.max()), dim=-1).values
        threshold = top.gather(1, (k_eff - 1)[:, None]).masked_fill(off[:, None], float("-inf"))
        return logits.masked_fill(logits < threshold, float("-inf"))

    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        # Ties with the k-th largest value are kept (as in vLLM).
        threshold = logits_sort.gather(1, (V - k)[:, None])
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, float("-inf"))
    cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - p[:, None]
    drop[:, -1] = False  # always keep the most likely token
    logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) draws a token with probability probs (Gumbel-max in disguise), and
    lets each seeded row fill its own q from its own generator: no other row can shift its random stream."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, gen in generators.items():
        q[i].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, token_ids: list[int], batch: SamplingBatch
) -> SamplerOutput:
    B = batch.num_rows
    rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
    idx = torch.tensor(rows, dtype=torch.long, device=raw_logprobs.device)
    lp = raw_logprobs.index_select(0, idx)
    chosen = lp.gather(1, sampled.index_select(0, idx)[:, None])  # [R, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_vals, top_ids = lp.topk(batch.max_num_logprobs, dim=-1)  # sorted, most likely first

    chosen_l, ranks_l, top_vals_l, top_ids_l = (
        chosen[:, 0].tolist(),
        ranks.tolist(),
        top_vals.tolist(),
        top_ids.tolist(),
    )
    logprobs: list[list[tuple[int, float]] | None] = [None] * B
    sampled_logprobs: list[float | None] = [None] * B
    sampled_ranks: list[int | None] = [None] * B
    for j, i in enumerate(rows):
        n = batch.num_logprobs[i]
        logprobs[i] = list(zip(top_ids_l[j][:n], top_vals_l[j][:n]))
        sampled_logprobs[i] = chosen_l[j]
        sampled_ranks[i] = ranks_l[j]
    return SamplerOutput(token_ids, logprobs, sampled_logprobs, sampled_ranks)


def _token_counts(
    B: int, V: int, rows: list[tuple[int, Sequence[int]]], device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32 occurrence counts of the given rows' token ids (other rows stay 0)."""
    counts = torch.zeros(B, V, dtype=torch.float32, device=device)
    tokens = _long(list(chain.from_iterable(toks for _, toks in rows)), device)
    if tokens.numel():
        row_ids = torch.repeat_interleave(
            _long([i for i, _ in rows], device), _long([len(t) for _, t in rows], device)
        )
        counts.index_put_((row_ids, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts


def _long(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
