"""The C++ CPU kernels against the torch code they replace.

layer_ops (RMSNorm, residual add + RMSNorm, SiLU-and-multiply, rotary) must round exactly where the torch
code rounds: in bf16 they are compared bit for bit, since one ulp here and there moves greedy tokens.
The decode kernel and write_kv are compared with a dense float32 reference and with index_copy_.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops as op_table
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged import decode_torch
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops():
    mod = op_table.kernel("layer_ops")
    assert mod is not None, (
        "the C++ layer ops did not build (compiler and ninja are installed by the Makefile)"
    )
    return mod


@pytest.fixture(scope="module")
def kernel():
    mod = op_table.kernel("attention_decode")
    assert mod is not None, "the C++ paged decode kernel did not build"
    return mod


def torch_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def assert_same(a, b, dtype):
    if dtype == torch.bfloat16:
        assert torch.equal(a, b), f"{(a != b).sum().item()} elements differ"
    else:  # float32: the C++ may fuse a multiply-add where torch rounds twice
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_of_squares_sums_in_atens_order(ops, dtype):
    # every width up to 300 (each remainder of the 8-lane vectors and 4 accumulators) and model widths
    # up to 14,336 (which go through the cascade's levels), rows spanning 12 orders of magnitude
    gen = torch.Generator().manual_seed(0)
    for width in [*range(1, 301), 576, 960, 1536, 2048, 3072, 4096, 5000, 8192, 11008, 14336]:
        x = (torch.randn(8, width, generator=gen) * torch.logspace(-3, 3, 8)[:, None]).to(dtype)
        expected = x.float().pow(2).mean(-1)
        assert torch.equal(ops.mean_of_squares(x), expected), f"width {width}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("width", [576, 100])  # 100: a row that ends in a partial 16-lane chunk
def test_norms_round_like_torch(ops, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, width, generator=gen) * 20).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    assert_same(ops.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5), dtype)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert_same(total, residual + x, dtype)
    assert_same(normed, torch_rms_norm(residual + x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_uses_the_kernel_and_leaves_inputs_alone(ops, dtype):
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    total, normed = norm.add_forward(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert_same(normed, torch_rms_norm(r0 + x0, norm.weight, 1e-6), dtype)
    # a row-strided view (a slice of a wider tensor) goes through too
    wide = torch.randn(5, 200).to(dtype)
    assert_same(norm(wide[:, :96]), torch_rms_norm(wide[:, :96], norm.weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 1000])
def test_silu_mul_rounds_like_torch(ops, dtype, width):
    gate_up = (torch.randn(33, 2 * width, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_same(ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


def test_silu_mul_matches_torch_bit_for_bit_at_every_width(ops):
    # bf16 rows go through layer_ops' own loop (Sleef's exp for each whole 64 values, std::exp for the
    # rest, as ATen's silu kernel splits a row): every tail length up to 300, model widths, three scales
    g = torch.Generator().manual_seed(5)
    for width in [*range(1, 301), 576, 1536, 3072, 8960, 14336]:
        for scale in (0.5, 4.0, 30.0):
            gate_up = (torch.randn(3, 2 * width, generator=g) * scale).to(torch.bfloat16)
            gate, up = gate_up.chunk(2, dim=-1)
            got, want = ops.silu_mul(gate_up), F.silu(gate) * up
            assert torch.equal(got, want), (width, scale, (got != want).sum().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_views_of_a_fused_projection(ops, dtype):
    t, heads, kv_heads, hd = 37, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=torch.Generator().manual_seed(4)).to(dtype)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.view(t, heads, hd), k.view(t, kv_heads, hd), v.view(t, kv_heads, hd)
    v0 = v.clone()
    cos, sin = RotaryEmbedding(hd, 4096, 10000.0).cos_sin(torch.arange(t) * 37, dtype)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    ops.rotary_(q, cos, sin)
    ops.rotary_(k, cos, sin)
    assert_same(q, want_q, dtype)
    assert_same(k, want_k, dtype)
    assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_kernel_equals_index_copy(kernel, dtype):
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(11, 6 * 32, generator=gen).to(dtype)  # k and v side by side, like a fused projection
    k, v = kv[:, :96].view(11, 3, 32), kv[:, 96:].view(11, 3, 32)
    slots = torch.randperm(8 * 16, generator=gen)[:11]
    got = torch.zeros(2, 8, 16, 3, 32, dtype=dtype)
    kernel.write_kv(k, v, got, slots)
    want = torch.zeros_like(got)
    want[0].view(-1, 3, 32).index_copy_(0, slots, k)
    want[1].view(-1, 3, 32).index_copy_(0, slots, v)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_kv(k, v, got, slots + 1000)


@pytest.mark.parametrize("lens", [[1, 15, 16, 17], [100, 300, 7, 64, 33]])
@pytest.mark.parametrize(
    "heads, kv_heads, hd",
    [(9, 3, 64), (4, 4, 64), (8, 2, 128), (14, 2, 64), (8, 1, 32), (10, 1, 64)],
    ids=["smollm2", "mha", "llama-hd128", "qwen2-7-per-kv", "hd32-generic", "10-per-kv-generic"],
)
def test_bf16_decode_kernel_against_float32_reference(kernel, lens, heads, kv_heads, hd):
    """bf16 K/V read in place through scattered, partly shared blocks (with prefetching ahead); the
    AVX512-BF16 tasks for head_dim 64 / 128 and 1-8 query heads per KV head, the generic tasks else."""
    gen = torch.Generator().manual_seed(sum(lens))
    bs = 16
    nblocks = [-(-n // bs) for n in lens]
    num_blocks = sum(nblocks) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, pos = torch.zeros(len(lens), max(nblocks), dtype=torch.long), 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(ids[pos : pos + nb])
        pos += nb
    tables[1, 0] = tables[0, 0]  # two sequences read the same physical block
    cache = torch.randn(2, num_blocks, bs, kv_heads, hd, generator=gen).bfloat16()
    q = torch.randn(len(lens), heads, hd, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=list(range(len(lens) + 1)),
        seq_lens=lens,
        block_tables=tables,
        num_decodes=len(lens),
        seq_lens_tensor=seq_lens,
        block_size=bs,
    )
    want = decode_torch(q.float(), cache.float(), meta, hd**-0.5)
    got = kernel.paged_decode(q, cache, tables, seq_lens, hd**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_bf16_rounding_keeps_denormals_and_writes_nan_as_c10_does(ops):
    # bf16_vec.h rounds with VCVTNEPS2BF16 except in 16-lane chunks holding a denormal or a NaN, which that
    # instruction flushes to zero or writes with its payload: torch keeps the denormal, and c10's rounding
    # writes any NaN as 0x7FC0 (ATen's vector loops write 0xFFFF: either is a NaN)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    x[0, ::7] = torch.tensor([1e-39, -3e-40, 5e-41]).repeat(5)[:14].to(torch.bfloat16)  # denormal in bf16
    x[1, 5] = torch.tensor(0x7F81, dtype=torch.int16).view(torch.bfloat16)  # a signalling NaN with a payload
    zeros, ones = torch.zeros_like(x), torch.ones_like(x)
    total, _ = ops.add_rms_norm(x, zeros, torch.ones(96, dtype=torch.bfloat16), 1e-5)
    silu = ops.silu_mul(torch.cat([x, ones], dim=1))  # silu(tiny) * 1: denormal products
    for got, want in ((total, zeros + x), (silu, F.silu(x) * ones)):
        bits, want_bits = got.view(torch.int16), want.view(torch.int16)
        assert (got[0] != 0).sum() > (x[0] == 0).sum()  # the denormals were not flushed
        assert torch.equal(bits[[0, 2, 3]], want_bits[[0, 2, 3]])
        assert torch.equal(bits[1, :5], want_bits[1, :5]) and torch.equal(bits[1, 6:], want_bits[1, 6:])
        assert bits[1, 5].item() == 0x7FC0
