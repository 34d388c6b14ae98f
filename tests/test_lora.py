"""Multi-LoRA serving (issue 37), offline: PEFT folders written by peft over a tiny random Llama, greedy
tokens against transformers + peft in float32, adapters and the base mixed in one step, the max_loras
limit, the prefix cache keyed by adapter, bad folders refused by name, the batched op against a loop."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import cli
from lora_helpers import reference_greedy, save_adapter, write_random_adapter
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_llama

from pagedllm import LLM, LoRARequest, SamplingParams, ops
from pagedllm.errors import InputError
from pagedllm.lora.layers import LoRABatch, LoRALinear
from pagedllm.lora.punica import FLOAT32_MAX_ROWS, add_lora
from pagedllm.quantization.linear import QuantLinear

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [
    [1, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200],
    [1, 4200, 17, 9000, 31, 77, 12000, 5],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base")
    a1 = save_adapter(base, root / "a1", seed=1)  # every linear, rank 8
    # a few modules, rank 4, rsLoRA's alpha / sqrt(r)
    a2 = save_adapter(
        base, root / "a2", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True
    )
    return root, base, a1, a2


@pytest.fixture(scope="module")
def references(folders):
    _, base, a1, a2 = folders
    return {
        (name, i): reference_greedy(base, adapter, prompt, MAX_TOKENS)
        for name, adapter in (("base", None), ("a1", a1), ("a2", a2))
        for i, prompt in enumerate(PROMPTS)
    }


def make_llm(base, **kwargs) -> LLM:
    options = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    options.update(kwargs)
    return LLM(model=str(base), show_progress=False, **options)


@pytest.fixture(scope="module")
def llm(folders):
    return make_llm(folders[1])


def requests(folders) -> dict[str, LoRARequest | None]:
    _, _, a1, a2 = folders
    return {"base": None, "a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2))}


def test_twelve_mixed_requests_equal_transformers_peft(llm, folders, references):
    """12 requests in one generate (so steps mix both adapters and the base), each equal to its own
    transformers + peft reference; and the adapters do change the base's tokens."""
    loras = requests(folders)
    names = [("base", "a1", "a2")[i % 3] for i in range(12)]
    prompts = [PROMPTS[i % 2] for i in range(12)]
    outs = llm.generate(prompts, GREEDY, lora_request=[loras[n] for n in names], use_tqdm=False)
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == references[(name, i % 2)], (i, name)
    assert references[("a1", 0)] != references[("base", 0)] != references[("a2", 0)]


def test_one_lora_request_for_every_prompt(llm, folders, references):
    outs = llm.generate(PROMPTS, GREEDY, lora_request=requests(folders)["a2"], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [references[("a2", 0)], references[("a2", 1)]]
    with pytest.raises(InputError, match="lora_requests for 2 prompts"):
        llm.generate(PROMPTS, GREEDY, lora_request=[None], use_tqdm=False)


def test_max_loras_one_waits_requests_of_another_adapter(folders, references):
    """max_loras=1: a step never holds two adapters (the scheduler waits the other's requests), and every
    request still equals its reference; the device slot is reused between adapters."""
    llm = make_llm(folders[1], max_loras=1)
    engine = llm.llm_engine
    loras = requests(folders)
    names = ["a1", "a2", "base", "a1", "a2"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", PROMPTS[0], GREEDY, lora_request=loras[name])
    outputs = {}
    while engine.has_unfinished_requests():
        active = {r.lora_int_id for r in engine.scheduler.running if r.lora_int_id}
        assert len(active) <= 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert [outputs[f"r{i}"] for i in range(5)] == [references[(n, 0)] for n in names]


def test_prefix_cache_keyed_by_adapter(folders):
    """A 48-token prompt (3 full blocks) under a1 then a2: no hit for a2 (its KV is not a1's); a1 again and
    the base twice hit their own."""
    llm = make_llm(folders[1])
    engine = llm.llm_engine
    loras = requests(folders)
    prompt = list(range(100, 148))

    def hits_of(lora) -> int:
        before = engine.get_stats().prefix_cache_hits
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), lora_request=lora, use_tqdm=False)
        return engine.get_stats().prefix_cache_hits - before

    assert hits_of(loras["a1"]) == 0
    assert hits_of(loras["a2"]) == 0
    assert hits_of(None) == 0
    assert hits_of(loras["a1"]) > 0
    assert hits_of(loras["a2"]) > 0
    assert hits_of(None) > 0


def test_bad_folders_refused_by_name(llm, folders, tmp_path):
    root, base, a1, _ = folders

    def refused(path, match, lid=50):
        with pytest.raises(InputError, match=match):
            llm.generate(
                [PROMPTS[0]], GREEDY, lora_request=LoRARequest("bad", lid, str(path)), use_tqdm=False
            )

    refused(tmp_path / "nowhere", "does not exist")
    no_weights = shutil.copytree(a1, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    refused(no_weights, "has no adapter_model.safetensors")
    no_config = shutil.copytree(a1, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    refused(no_config, "has no adapter_config.json")
    # a target module this model lacks: a1's weights renamed to w_proj
    alien = shutil.copytree(a1, tmp_path / "alien")
    tensors = load_file(str(alien / "adapter_model.safetensors"))
    save_file(
        {k.replace("q_proj", "w_proj"): v for k, v in tensors.items()},
        str(alien / "adapter_model.safetensors"),
    )
    refused(alien, "targets 'w_proj', which this model does not have")
    # another base's shapes: an adapter of a wider Llama
    wide = save_tiny_llama(root / "wide", hidden_size=96)
    refused(save_adapter(wide, tmp_path / "wide_adapter", seed=3), "another base")
    refused(
        save_adapter(base, tmp_path / "embed", seed=4, targets=["embed_tokens", "q_proj"]), "embed_tokens"
    )
    refused(save_adapter(base, tmp_path / "head", seed=5, targets=["lm_head"]), "lm_head")
    dora = shutil.copytree(a1, tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused(dora, "use_dora")
    # the engine serves on, and nothing bad was registered
    assert "bad" not in [r.lora_name for r in llm.llm_engine.list_loras()]
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_rank_above_max_refused(folders):
    llm = make_llm(folders[1], max_lora_rank=4)
    with pytest.raises(InputError, match="rank 8, above max_lora_rank 4"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=requests(folders)["a1"], use_tqdm=False)


def test_options_refused_by_name(folders):
    base = folders[1]
    with pytest.raises(InputError, match="enable_lora=True"):
        LLM(model=str(base), dtype="float32", num_kv_blocks=16, show_progress=False).generate(
            [PROMPTS[0]], GREEDY, lora_request=requests(folders)["a1"], use_tqdm=False
        )
    with pytest.raises(InputError, match="tensor_parallel_size"):
        make_llm(base, tensor_parallel_size=2)
    with pytest.raises(InputError, match="max_cpu_loras"):
        make_llm(base, max_loras=2, max_cpu_loras=1)
    with pytest.raises(InputError, match="lora_int_id"):
        LoRARequest("x", 0, "/nowhere")


def test_quantized_base_keeps_its_quantized_linears(folders):
    """int8 base: the QuantLinear serves inside each LoRALinear; the adapter's float product changes the
    output, and a1 alone equals a1 mixed with the base."""
    llm = make_llm(folders[1], quantization="int8")
    wrapped = [m for m in llm.llm_engine.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(isinstance(m.base, QuantLinear) for m in wrapped)
    loras = requests(folders)
    alone = (
        llm.generate([PROMPTS[0]], GREEDY, lora_request=loras["a1"], use_tqdm=False)[0].outputs[0].token_ids
    )
    base = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=[None, loras["a1"]], use_tqdm=False)
    assert alone != base
    assert [o.outputs[0].token_ids for o in mixed] == [base, alone]


@pytest.mark.parametrize("backend", ["table", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [7, 700])  # 700: past the C++ op's one-thread size, the parallel path
def test_op_equals_a_loop_over_rows(backend, dtype, num_rows):
    """The op (the table's backend: C++ where it builds, and the torch reference) gives every row its own
    slot's product (block-diagonal over 3 slices), added to y, and exactly nothing to a base row."""
    g = torch.Generator().manual_seed(0)
    slots, n, r, d, widths = (
        3,
        3,
        3,
        40,
        (24, 8, 8),
    )  # rank 3: the C++ shrink's rows 4 at a time, and a remainder
    a = torch.randn(slots, n, r, d, generator=g)
    bs = [[torch.randn(w, r, generator=g) for w in widths] for _ in range(slots)]
    b = torch.zeros(sum(widths), slots * n * r)
    for s in range(slots):
        off = 0
        for i, w in enumerate(widths):
            col = (s * n + i) * r
            b[off : off + w, col : col + r] = bs[s][i]
            off += w
    batch = LoRABatch(num_slots=slots, rank=r)
    row_slots = torch.tensor([0, -1, 2, 1, 2, -1, 0] * (num_rows // 7))
    batch.set(row_slots)
    x = torch.randn(len(row_slots), d, generator=g).to(dtype)
    y = torch.randn(len(row_slots), sum(widths), generator=g).to(dtype)
    full = (a.reshape(-1, d), b.T.contiguous())
    half = tuple(t.to(dtype) for t in full) if dtype != torch.float32 else None
    with ops.forced(**({"lora": "torch"} if backend == "torch" else {})):
        got = add_lora(y.clone(), x, full, half, batch, list(widths))
    assert got.dtype == dtype
    for t, s in enumerate(row_slots.tolist()):
        if s < 0:
            assert torch.equal(got[t], y[t])
            continue
        delta = torch.cat([bs[s][i] @ (a[s, i] @ x[t].float()) for i in range(n)])
        # bf16: x, the weights, y and the sum each rounded to 8 bits (products of ~10, some cancelling)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.3, rtol=0.03)
        torch.testing.assert_close(got[t].float(), y[t].float() + delta, **tol)


def test_plan_counts_the_adapter_memory_the_engine_allocates(llm, folders, capsys):
    """`pagedllm plan --lora-rank R --max-loras N`: the device slots are the bytes of the engine's
    LoRALinear buffers (same rank, slots and dtype), and the adapters count against the budget."""
    base = str(folders[1])
    slots = sum(
        m.lora_a.nbytes + m.lora_b.nbytes for m in llm.llm_engine.model.modules() if isinstance(m, LoRALinear)
    )
    args = ["plan", "--model", base, "--dtype", "fp32", "--seq-len", "64", "--json", "--memory", "1GiB"]
    rc, out, err = cli(capsys, *args, "--weight-dtype", "fp32", "--lora-rank", "8", "--max-loras", "2")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["lora_slot_bytes"] == slots
    assert plan["lora_bytes"] == slots + plan["lora_cpu_bytes"] and plan["max_cpu_loras"] == 2
    rc, out, _ = cli(capsys, *args, "--weight-dtype", "fp32")
    assert json.loads(out)["kv_budget_bytes"] == plan["kv_budget_bytes"] + plan["lora_bytes"]
    rc, _, err = cli(capsys, *args, "--max-loras", "2")
    assert rc != 0 and "--max-loras needs --lora-rank" in err


def test_gguf_native_base_keeps_its_blocks(tmp_path):
    """The default model served from its GGUF blocks: every LoRALinear wraps a QuantLinear, an adapter
    changes the output, and a mixed step gives the base row and the adapter row their own tokens."""
    llm = LLM(
        model="default",
        dtype="fp32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
        num_kv_blocks=64,
        enable_prefix_caching=False,  # a chunk after cached tokens attends in another order (README)
        show_progress=False,
    )
    engine = llm.llm_engine
    wrapped = [m for m in engine.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(isinstance(m.base, QuantLinear) for m in wrapped)
    modules = {layer: ["q_proj", "down_proj"] for layer in range(engine.model_config.num_layers)}
    adapter = write_random_adapter(tmp_path / "a", engine.model_config, 4, modules, scale=0.5, seed=0)
    lora = LoRARequest("g", 1, str(adapter))
    prompt = llm.get_tokenizer().encode(
        "The paged KV cache stores keys and values in blocks; the capital of France is"
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    alone = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([prompt] * 2, params, lora_request=[None, lora], use_tqdm=False)
    assert alone[0] != base[0]
    # the base row is untouched by the adapter row beside it; the adapter row's first token (the prefill's)
    # is the adapter's. Its later tokens may move: the GGUF kernel rounds activations to int8, which turns
    # a ~1e-7 difference of the adapter's product between 1 and 2 decode rows into whole steps once this
    # strong random adapter has made the logits close (the README's batch-invariance section); exact
    # equality of mixed steps is tested in float32 on the dense model above, against peft
    assert mixed[0].outputs[0].token_ids == base
    assert mixed[1].outputs[0].token_ids[0] == alone[0]


@pytest.mark.parametrize("backend", ["table", "torch"])
def test_a_bf16_model_adds_the_adapter_product(backend):
    """LoRALinear over a bf16 linear, on few rows and many: the reference takes float32 weights up to
    FLOAT32_MAX_ROWS rows and the bf16 copy beyond, the C++ backend the bf16 copy; each is the adapter's
    product (to bf16 rounding), and a base row gets exactly nothing."""
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 24, bias=False).to(torch.bfloat16)
    batch = LoRABatch(num_slots=2, rank=4)
    layer = LoRALinear(base, 32, (("q_proj", 24),), batch, torch.bfloat16)
    a, b = torch.randn(4, 32), torch.randn(24, 4)
    layer.set_slot(1, {"q_proj": (a, b)})
    for rows in (FLOAT32_MAX_ROWS, FLOAT32_MAX_ROWS + 8):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        slots = torch.tensor([1, -1] * (rows // 2))
        batch.set(slots)
        with ops.forced(**({"lora": "torch"} if backend == "torch" else {})):
            got = layer(x).float() - base(x).float()
        want = (x.float() @ a.T @ b.T) * (slots == 1)[:, None]
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.03)
        assert (got[slots == -1] == 0).all()
