"""KV-cache arithmetic against the spec's acceptance table (C1-C4, C9), to the byte."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm import planner
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.units import format_size

GiB, MiB = 1024**3, 1024**2


def test_dtype_bytes():
    assert planner.DTYPE_BYTES == {
        "fp32": 4,
        "fp16": 2,
        "bf16": 2,
        "fp8": 1,
        "int8": 1,
        "int4": Fraction(1, 2),
    }
    assert planner.dtype_bytes("float16") == 2 and planner.dtype_bytes("BF16") == 2


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(InputError) as e:
        planner.kv_bytes_per_token(6, 512, "fp5")
    assert "'fp5'" in str(e.value)
    assert "fp32, fp16, bf16, fp8, int8, int4" in str(e.value)
    assert e.value.param == "dtype"


def test_c1_small_model():
    # L=6, d_model=512, FP16, B=1, S=128 -> 1,572,864 bytes = 1.5 MiB; INT8 gives 0.75 MiB
    assert planner.kv_bytes(1, 128, 6, 512, "fp16") == 1_572_864 == int(1.5 * MiB)
    assert format_size(1_572_864) == "1.5 MiB"
    assert planner.kv_bytes(1, 128, 6, 512, "int8") == 786_432 == int(0.75 * MiB)


def test_c2_batch_limit():
    per_request = planner.kv_bytes(1, 4096, 40, 5120, "fp16")
    assert per_request == 3_355_443_200
    assert format_size(per_request) == "3.125 GiB"
    assert format_size(per_request, binary=False) == "3.355 GB"
    cap = planner.capacity(40 * GiB, per_request)
    assert cap.kv_budget_bytes == 40 * GiB  # no weights given: the memory itself is the budget
    assert cap.max_concurrent == 12
    assert cap.leftover_bytes == 2_684_354_560 == int(2.5 * GiB)


def test_c3_one_token():
    per_token = planner.kv_bytes_per_token(40, 5120, "fp16")
    assert per_token == 819_200 == planner.kv_bytes(1, 1, 40, 5120)
    block = planner.block_bytes(16, per_token)
    assert block == 13_107_200 == int(12.5 * MiB)
    w = planner.waste(None, 16, 1)
    assert (w.blocks_per_request, w.paged_slots, w.paged_waste_tokens) == (1, 16, 15)
    assert w.paged_waste_tokens * per_token == 12_288_000
    assert w.last_block_waste == Fraction(15, 16) and float(w.last_block_waste) == 0.9375
    assert w.naive_waste_tokens is None and w.ratio is None


def test_c4_paged_vs_naive():
    w = planner.waste(2048, 16, 100)
    assert w.blocks_per_request == 7
    assert w.paged_slots == 112
    assert w.paged_waste_tokens == 12
    assert w.naive_waste_tokens == 1948
    assert w.ratio == Fraction(1948, 12)
    assert int(w.ratio) == 162


def test_c9_users_on_one_gpu():
    per_user = int(3.125 * GiB)
    fp16 = planner.capacity(80 * GiB, per_user, weights=26 * GiB, overhead=4 * GiB)
    int4 = planner.capacity(80 * GiB, per_user, weights=int(6.5 * GiB), overhead=4 * GiB)
    assert fp16.kv_budget_bytes == 50 * GiB and fp16.max_concurrent == 16 and fp16.leftover_bytes == 0
    assert int4.kv_budget_bytes == int(69.5 * GiB) and int4.max_concurrent == 22
    assert int4.leftover_bytes == int(0.75 * GiB)
    assert int4.max_concurrent - fp16.max_concurrent == 6


def test_c9_weights_from_param_count():
    params = 13_958_643_712  # 26 GiB in fp16
    assert planner.weight_bytes(params, "fp16") == 26 * GiB
    assert planner.weight_bytes(params, "int4") == int(6.5 * GiB)
    assert planner.weight_bytes(3, "int4") == 2  # half bytes round up to a whole byte


def test_int4_kv_is_whole_bytes():
    assert planner.kv_bytes_per_token(1, 3, "int4") == 3
    assert planner.kv_bytes(2, 5, 3, 7, "int4") == 2 * 5 * 3 * 7


def test_kv_width_gqa():
    assert planner.kv_width(3, 64) == 192
    assert planner.kv_width(8, 128) == 1024


SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)
LLAMA2_7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
)


def test_param_count_matches_published_models():
    assert planner.param_count(SMOLLM2_135M) == 134_515_008
    assert planner.param_count(LLAMA2_7B) == 6_738_415_616


def test_param_count_untied_and_bias():
    untied = ModelConfig(**{**SMOLLM2_135M.__dict__, "tie_word_embeddings": False})
    assert planner.param_count(untied) == 134_515_008 + 49152 * 576
    biased = ModelConfig(**{**SMOLLM2_135M.__dict__, "attention_bias": True})
    assert planner.param_count(biased) == 134_515_008 + 30 * (576 + 2 * 192)


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda: planner.kv_width(0, 64), "num_kv_heads"),
        (lambda: planner.kv_bytes(-1, 128, 6, 512), "batch"),
        (lambda: planner.kv_bytes(1, 0, 6, 512), "seq_len"),
        (lambda: planner.kv_bytes_per_token(6, 1.5), "kv_width"),
        (lambda: planner.block_bytes(0, 100), "block_size"),
        (lambda: planner.capacity(10 * GiB, 1, weights=8 * GiB, overhead=4 * GiB), "memory"),
        (lambda: planner.capacity(10 * GiB, 0), "per_request"),
        (lambda: planner.capacity(-1, 10), "memory"),
        (lambda: planner.waste(100, 16, 101), "seq_len"),
        (lambda: planner.weight_bytes(-5, "fp16"), "num_params"),
    ],
)
def test_bad_input_names_the_field(call, param):
    with pytest.raises(InputError) as e:
        call()
    assert e.value.param == param


@given(st.integers(1, 100_000), st.integers(1, 512), st.integers(0, 100_000))
def test_waste_properties(seq_len, block_size, extra):
    w = planner.waste(seq_len + extra, block_size, seq_len)
    assert 0 <= w.paged_waste_tokens < block_size
    assert w.paged_slots == w.blocks_per_request * block_size >= seq_len
    assert (w.blocks_per_request - 1) * block_size < seq_len
    assert w.naive_waste_tokens == extra


@given(st.integers(0, 2**45), st.integers(1, 2**35), st.integers(0, 2**40))
def test_capacity_properties(memory, per_request, weights):
    if weights > memory:
        return
    cap = planner.capacity(memory, per_request, weights=weights)
    assert cap.max_concurrent * per_request + cap.leftover_bytes == memory - weights
    assert 0 <= cap.leftover_bytes < per_request


# ---- build_plan / format_plan: the report `pagedllm plan` prints, without argparse ------------------


def test_build_plan_without_the_cli():
    p = planner.build_plan(
        num_layers=40, d_model=5120, seq_len=4096, memory="80GiB", weights=26 * 1024**3, overhead="4GiB"
    )
    assert p["kv_bytes_per_request"] == 3_355_443_200
    assert p["kv_budget_bytes"] == 50 * 1024**3 and p["max_concurrent_requests"] == 16
    assert "3,355,443,200 bytes (3.125 GiB = 3.355 GB)" in planner.format_plan(p)


def test_build_plan_from_a_config_and_its_errors():
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    p = planner.build_plan(config=cfg, model="tiny", model_path="/x/tiny")
    assert p["seq_len"] == 256 and p["seq_len_from_model"] and p["kv_width"] == 32
    assert p["num_params"] == planner.param_count(cfg)
    assert planner.format_plan(p).startswith(f"model tiny (/x/tiny): {p['num_params']:,} parameters")
    with pytest.raises(InputError, match="nothing to plan"):
        planner.build_plan()
    with pytest.raises(InputError, match="not both"):
        planner.build_plan(config=cfg, weights="1GiB", weight_dtype="int4")
