"""ops.forced(<op>="torch") changes what runs, for each of the 9 ops of the table (ops.py), on any tier.

Each test watches what actually executes, not what the table says: the ATen ops the torch profiler records
(our C++ kernels are plain pybind calls, so the reference's ATen ops appear only when the reference runs),
the type of the layers a build made, or the calls into the fused stack. The first half of each test runs
the op as the table chose it, the second half forced to the reference; where the table itself chose the
reference on this CPU (a lower tier, no compiler), both halves must show the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams, ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged import paged_attention, write_kv
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.uniform import quantize
from pagedllm.worker.sampler import greedy


def aten_ops(fn) -> set[str]:
    """The ATen op names that running fn() records."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def chose_kernel(op: str) -> bool:
    return ops.table()[op].backend != ops.REFERENCE


def check(op: str, fn, reference_marker: str) -> None:
    """fn() records `reference_marker` (an ATen op of the reference) exactly when the reference runs."""
    assert (reference_marker in aten_ops(fn)) == (not chose_kernel(op)), (op, ops.table()[op])
    with ops.forced(**{op: "torch"}):
        assert ops.kernel(op) is None
        assert reference_marker in aten_ops(fn), f"forced {op}=torch did not run the reference"


def decode_step(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 8, 16, 2, 64, generator=gen).to(dtype)
    lens = [5, 20]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([4, 16 + 3]),
        query_start_loc=[0, 1, 2],
        seq_lens=lens,
        block_tables=torch.tensor([[0, 7], [3, 1]]),
        num_decodes=2,
        seq_lens_tensor=torch.tensor(lens),
        block_size=16,
    )
    q = torch.randn(2, 6, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, 64, generator=gen).to(dtype)
    return q, k, k.clone(), cache, meta


def test_layer_ops():
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        check("layer_ops", lambda: norm(x), "aten::rsqrt")


def test_attention_decode():
    q, k, v, cache, meta = decode_step()
    with torch.inference_mode():
        check("attention_decode", lambda: paged_attention(q, k, v, cache, meta, 0.125), "aten::index_select")


def test_write_kv():
    _, k, v, cache, meta = decode_step()
    with torch.inference_mode():
        check("write_kv", lambda: write_kv(cache, k, v, meta.slot_mapping), "aten::index_copy_")


def test_attention_prefill():
    """The table picks torch's SDPA on every tier; the reference is the eager formula (matmul, softmax)."""
    gen = torch.Generator().manual_seed(1)
    n = 7
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=torch.tensor([[0]]),
        num_decodes=0,
        seq_lens_tensor=torch.tensor([n]),
        block_size=16,
    )
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (4, 2, 2))
    cache = torch.zeros(2, 1, 16, 2, 32)
    run = lambda: paged_attention(q, k, v, cache, meta, 32**-0.5)  # noqa: E731
    assert ops.table()["attention_prefill"].backend == "sdpa"
    with torch.inference_mode():
        fast = run()
        assert "aten::scaled_dot_product_attention" in aten_ops(run)
        with ops.forced(attention_prefill="torch"):
            names = aten_ops(run)
            assert "aten::scaled_dot_product_attention" not in names and "aten::_softmax" in names
            torch.testing.assert_close(run(), fast, atol=1e-5, rtol=1e-5)


def test_quantized_linear():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen)
    layer = QuantLinear.from_quantized(quantize(w, bits=4, group_size=32, axis=1))
    x = torch.randn(3, 128, generator=gen)
    layer.pack(torch.float32)
    with torch.inference_mode():
        check("quantized_linear", lambda: layer(x), "aten::linear")
        with ops.forced(quantized_linear="torch"):
            layer(x)
            assert layer.kernel is None and layer.layout == ()
        layer(x)  # back under the table's backend: its kernel again
        assert (layer.kernel is not None) == (ops.backend("quantized_linear") in ("amx", "avx2"))


def test_argmax():
    logits = torch.randn(4, 1000)
    check("argmax", lambda: greedy(logits), "aten::max")


@pytest.fixture(scope="module")
def llm():
    return LLM(model="default", kv_cache_memory="64MiB", max_num_seqs=4)


def test_lora():
    """The C++ op adds the adapters with no ATen matmul; the reference is the masked stacked product (mm)."""
    from pagedllm.lora.layers import LoRABatch
    from pagedllm.lora.punica import add_lora

    gen = torch.Generator().manual_seed(0)
    batch = LoRABatch(num_slots=2, rank=4)
    batch.set(torch.tensor([1, -1, 0]))
    a, b_t = torch.randn(2 * 4, 32, generator=gen), torch.randn(2 * 4, 24, generator=gen)
    x, y = torch.randn(3, 32, generator=gen), torch.randn(3, 24, generator=gen)
    check("lora", lambda: add_lora(y.clone(), x, (a, b_t), None, batch, [24]), "aten::mm")


def test_linear():
    """Decided at build: bf16 weights prepacked for oneDNN, or nn.Linear (F.linear) under the reference."""
    from pagedllm.model.build import load_model_for_inference
    from pagedllm.model.layers.packed_linear import PackedLinear
    from pagedllm.model.loader import default_model_path

    def lm_head_type() -> type:
        model, _ = load_model_for_inference(default_model_path(), torch.bfloat16, None, show_progress=False)
        return type(model.lm_head)

    assert (lm_head_type() is PackedLinear) == chose_kernel("linear")
    with ops.forced(linear="torch"):
        assert lm_head_type() is torch.nn.Linear


def test_decoder_stack(llm):
    """Steps through the fused stack, or through the layer loop inside forced(decoder_stack="torch"); the
    same greedy tokens either way (the stack makes the same calls as the loop)."""
    model = llm.llm_engine.model
    stack = model.decode_stack
    assert (stack is not None) == chose_kernel("decoder_stack")
    calls = []

    class Spy:
        def forward(self, *args):
            calls.append(args)
            return stack.forward(*args)

    params = SamplingParams(temperature=0, max_tokens=8)
    if stack is not None:
        model.decode_stack = Spy()
    try:
        fused = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
        assert bool(calls) == (stack is not None)
        calls.clear()
        with ops.forced(decoder_stack="torch"):
            loop = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
        assert not calls
    finally:
        model.decode_stack = stack
    assert loop == fused
