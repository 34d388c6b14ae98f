"""Paged attention against a dense causal reference, on scattered and shared block tables."""

import math

import pytest
import torch

from pagedllm import ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged import paged_attention, write_kv

BS, H, KVH, HD = 16, 6, 2, 32


def dense_reference(q, k, v, prefix):
    """q [n, H, hd], k/v [ctx, KVH, hd]; query j is at position prefix + j."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n, ctx = q.shape[0], k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (prefix + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_step(seqs, num_blocks, gen):
    """seqs: list of (context_len, num_new, block_table). Returns q, k, v, meta, full K/V per sequence."""
    cache = torch.zeros(2, num_blocks, BS, KVH, HD)
    fulls, qs, ks, vs, slots = [], [], [], [], []
    loc, lens, tables = [0], [], []
    for ctx, n, table in seqs:
        kf = torch.randn(ctx, KVH, HD, generator=gen)
        vf = torch.randn(ctx, KVH, HD, generator=gen)
        # the cached prefix is written into the cache beforehand, the new tokens by the step itself
        pos = torch.arange(ctx)
        s = torch.tensor(table)[pos // BS] * BS + pos % BS
        write_kv(cache, kf[: ctx - n], vf[: ctx - n], s[: ctx - n])
        q = torch.randn(n, H, HD, generator=gen)
        fulls.append((q, kf, vf, ctx - n))
        qs.append(q), ks.append(kf[ctx - n :]), vs.append(vf[ctx - n :]), slots.append(s[ctx - n :])
        loc.append(loc[-1] + n)
        lens.append(ctx)
        tables.append(table)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=loc,
        seq_lens=lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for _, n, _ in seqs if n == 1),
        seq_lens_tensor=torch.tensor(lens),
        block_size=BS,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, fulls


def scattered_tables(lengths, num_blocks, gen):
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for ctx in lengths:
        need = -(-ctx // BS)
        tables.append([perm.pop() for _ in range(need)])
    return tables


@pytest.mark.parametrize("lengths", [[1, 15, 16, 17, 100], [100, 17, 16, 15, 1], [33]])
def test_decode_and_prefill_match_dense(lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    num_blocks = 64
    # decodes (one new token, the rest cached), then a whole prefill and a chunk after a cached prefix
    shapes = [(ctx, 1) for ctx in lengths] + [(17, 17), (100, 37)]
    tables = scattered_tables([ctx for ctx, _ in shapes], num_blocks, gen)
    seqs = [(ctx, n, t) for (ctx, n), t in zip(shapes, tables)]
    q, k, v, cache, meta, fulls = build_step(seqs, num_blocks, gen)
    write_kv(cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, cache, meta, HD**-0.5)
    for i, (qi, kf, vf, prefix) in enumerate(fulls):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        torch.testing.assert_close(out[a:b], dense_reference(qi, kf, vf, prefix), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "ctx,new", [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100), (100, 37), (33, 17), (48, 16)]
)
def test_prefill_with_and_without_cached_prefix(ctx, new):
    gen = torch.Generator().manual_seed(ctx * 1000 + new)
    num_blocks = 32
    # a decode of another sequence rides along in the same step
    other, table = scattered_tables([20, ctx], num_blocks, gen)
    seqs = [(20, 1, other), (ctx, new, table)]
    q, k, v, cache, meta, fulls = build_step(seqs, num_blocks, gen)
    write_kv(cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, cache, meta, HD**-0.5)
    for i, (qi, kf, vf, prefix) in enumerate(fulls):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        torch.testing.assert_close(out[a:b], dense_reference(qi, kf, vf, prefix), atol=1e-5, rtol=1e-5)


def test_shared_blocks_are_read_by_both_sequences():
    """Two sequences whose tables point at the same physical prefix blocks (prefix sharing)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.zeros(2, 16, BS, KVH, HD)
    shared = [9, 3]  # 32 tokens of common prefix, non-contiguous
    ta, tb = shared + [12], shared + [5]
    prefix_k, prefix_v = torch.randn(32, KVH, HD, generator=gen), torch.randn(32, KVH, HD, generator=gen)
    pos = torch.arange(32)
    write_kv(cache, prefix_k, prefix_v, torch.tensor(shared)[pos // BS] * BS + pos % BS)
    tails = [
        (torch.randn(5, KVH, HD, generator=gen), torch.randn(5, KVH, HD, generator=gen)) for _ in range(2)
    ]
    for (tk, tv), t in zip(tails, (ta, tb)):
        write_kv(cache, tk[:4], tv[:4], torch.tensor([t[2] * BS + j for j in range(4)]))
    q = torch.randn(2, H, HD, generator=gen)
    k = torch.stack([tails[0][0][4], tails[1][0][4]])
    v = torch.stack([tails[0][1][4], tails[1][1][4]])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([ta[2] * BS + 4, tb[2] * BS + 4]),
        query_start_loc=[0, 1, 2],
        seq_lens=[37, 37],
        block_tables=torch.tensor([ta, tb]),
        num_decodes=2,
        seq_lens_tensor=torch.tensor([37, 37]),
        block_size=BS,
    )
    write_kv(cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, cache, meta, HD**-0.5)
    for i, (tk, tv) in enumerate(tails):
        kf, vf = torch.cat([prefix_k, tk]), torch.cat([prefix_v, tv])
        torch.testing.assert_close(
            out[i : i + 1], dense_reference(q[i : i + 1], kf, vf, 36), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_torch_decode(dtype):
    """The C++ decode kernel (built on first use) against the pure-torch gather + SDPA path."""
    from pagedllm.attention.paged import decode_torch

    kernel = ops.kernel("attention_decode")
    assert kernel is not None, (
        "the C++ decode kernel failed to build (compiler and ninja are installed by setup)"
    )
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 15, 16, 17, 100, 33]
    tables = scattered_tables(lengths, 64, gen)
    cache = torch.randn(2, 64, BS, KVH, HD, generator=gen).to(dtype)
    q = torch.randn(len(lengths), H, HD, generator=gen).to(dtype)
    width = max(len(t) for t in tables) + 2  # wider than needed, like a real batch's padded tables
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long),
        query_start_loc=list(range(len(lengths) + 1)),
        seq_lens=lengths,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=len(lengths),
        seq_lens_tensor=torch.tensor(lengths),
        block_size=BS,
    )
    got = kernel.paged_decode(q, cache, meta.block_tables, meta.seq_lens_tensor, HD**-0.5)
    want = decode_torch(q, cache, meta, HD**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- sliding windows and soft-capped scores


def windowed_reference(q, k, v, prefix, window=None, softcap=None):
    """dense_reference with a sliding window (query at p sees p - window + 1 .. p) and Gemma 2's cap."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n, ctx = q.shape[0], k.shape[0]
    queries, keys = (prefix + torch.arange(n))[:, None], torch.arange(ctx)[None, :]
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def poison_before_windows(cache, meta, window, poison: int) -> None:
    """Point every table entry wholly before its row's window at a block of NaNs, as if the block had been
    freed (the runner reads a freed entry as some other block): a kernel that read one would return NaN."""
    cache[:, poison] = float("nan")
    for i in range(meta.num_seqs):
        n = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        first_needed = max(0, meta.seq_lens[i] - n - window + 1)
        meta.block_tables[i, : first_needed // BS] = poison


@pytest.mark.parametrize("window, softcap", [(20, None), (20, 2.0), (None, 2.0), (1, None), (64, None)])
@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_window_and_softcap_match_dense(window, softcap, backend):
    if backend == "kernel" and ops.kernel("attention_decode") is None:
        pytest.fail("the C++ decode kernel failed to build (compiler and ninja are installed by setup)")
    forced = {"attention_decode": "torch", "write_kv": "torch", "attention_prefill": "torch"}
    with ops.forced(**(forced if backend == "torch" else {})):
        _window_and_softcap_match_dense(window, softcap)


def _window_and_softcap_match_dense(window, softcap):
    gen = torch.Generator().manual_seed(5)
    num_blocks = 64
    # decodes at several lengths, a fresh prompt longer than the window, chunks over cached prefixes
    shapes = [(1, 1), (19, 1), (20, 1), (21, 1), (100, 1), (37, 37), (100, 37), (70, 5)]
    tables = scattered_tables([ctx for ctx, _ in shapes], num_blocks - 1, gen)
    q, k, v, cache, meta, fulls = build_step(
        [(ctx, n, t) for (ctx, n), t in zip(shapes, tables)], num_blocks, gen
    )
    q = q * 3  # larger scores, so the cap bites
    write_kv(cache, k, v, meta.slot_mapping)
    if window is not None:
        poison_before_windows(cache, meta, window, num_blocks - 1)
    out = paged_attention(q, k, v, cache, meta, HD**-0.5, window, softcap)
    for i, (qi, kf, vf, prefix) in enumerate(fulls):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        want = windowed_reference(qi * 3, kf, vf, prefix, window, softcap)
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)


def test_bf16_window_kernel_matches_its_reference():
    """bf16 windows take the generic kernel tasks (the AVX512-BF16 ones attend to whole contexts)."""
    from pagedllm.attention.paged import decode_torch

    kernel = ops.kernel("attention_decode")
    assert kernel is not None
    gen = torch.Generator().manual_seed(9)
    lengths = [1, 20, 21, 100]
    tables = scattered_tables(lengths, 32, gen)
    cache = torch.randn(2, 32, BS, KVH, HD, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(lengths), H, HD, generator=gen).to(torch.bfloat16)
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(torch.zeros(4, dtype=torch.long), [0, 1, 2, 3, 4], lengths, tables_t, 4,
                             torch.tensor(lengths), BS)  # fmt: skip
    got = kernel.paged_decode(q, cache, tables_t, meta.seq_lens_tensor, HD**-0.5, 20, 0.0)
    want = decode_torch(q.float(), cache.float(), meta, HD**-0.5, 20)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
