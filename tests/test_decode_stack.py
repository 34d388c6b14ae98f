"""The C++ decode stack (model/decode_stack.py): all decoder layers of a step in one call.

It makes the Python layer loop's calls from C++, so it must give the loop's hidden states and KV cache
bit for bit, for fresh prefills and decode batches of every size (the 1-8 row kernel and the AMX tiles;
the AVX2 int8-activation kernel in float32 and bf16 on every tier from avx2 up), and step aside for
everything else.
"""

import pytest
import torch
from tiny_models import save_tiny_llama, save_tiny_qwen2

from pagedllm import LLM, SamplingParams, ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model import decode_stack
from pagedllm.model.build import build_model
from pagedllm.model.fuse import fuse_for_inference
from pagedllm.model.loader import default_model_path

BF16 = torch.bfloat16
FP32 = torch.float32
# the kernels the op table hands out on this machine (None where it runs the torch reference)
AMX = ops.kernel("quantized_linear", "woq_amx")
AVX2 = ops.kernel("quantized_linear", "woq_avx2")
STACK = ops.kernel("decoder_stack")
# bf16 linears prepacked for oneDNN at build (the table's choice: not below the native-bf16 tiers, even where
# the oneDNN probe passes, e.g. with PAGEDLLM_CPU_ISA=avx2)
PREPACKED = ops.backend("linear") == "onednn-prepacked"
needs_amx = pytest.mark.skipif(AMX is None, reason="no AMX on this CPU (or no compiler)")
needs_avx2 = pytest.mark.skipif(
    AVX2 is None or STACK is None, reason="no AVX2 kernel on this CPU (or no compiler)"
)
needs_prepacking = pytest.mark.skipif(
    not PREPACKED or STACK is None, reason="no oneDNN prepacking at this tier (or no compiler)"
)


def fused(path, quantization, dtype=BF16):
    model, _ = build_model(path, dtype, quantization, show_progress=False)
    fuse_for_inference(model)
    return model


@pytest.fixture(scope="module")
def gguf_model():
    return fused(default_model_path(), "gguf")


@pytest.fixture(scope="module")
def bf16_model():
    return fused(default_model_path(), None)


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory):  # q/k/v bias, 3 heads over 1 KV head, head_dim 32
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def tiny_qwen2_int4(tiny_qwen2_path):
    return fused(tiny_qwen2_path, "int4")


@pytest.fixture(scope="module")
def tiny_llama_int8(tmp_path_factory):
    return fused(save_tiny_llama(tmp_path_factory.mktemp("llama")), "int8")


def stack_and_loop(model, lengths: list[int], steps: int, block_size: int = 16, before_step=None):
    """Prefill len(lengths) random sequences one by one, then decode `steps` tokens for all of them
    together; every step once through the stack and once through the layer loop, on two copies of the
    caches. before_step([(sequence, rows)]), where given, is told each step's rows first (LoRA's row map).
    Returns [(stack hidden, loop hidden)] for every step and the two final caches."""
    cfg = model.config
    gen = torch.Generator().manual_seed(sum(lengths))
    total = [n + steps for n in lengths]
    # scattered, interleaved block tables: block b of sequence i is 1 + i + b * len(lengths)
    blocks = [-(-n // block_size) for n in total]
    tables = [[1 + i + b * len(lengths) for b in range(nb)] for i, nb in enumerate(blocks)]
    num_blocks = 2 + max(max(t) for t in tables)
    dtype = model.dtype
    caches = [
        torch.zeros(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        for _ in range(cfg.num_layers)
    ]
    loop_caches = [c.clone() for c in caches]
    width = max(blocks)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables])

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    ids = [torch.randint(3, cfg.vocab_size, (n,), generator=gen) for n in total]
    stack = model.decode_stack
    hidden = []

    def both(step_ids, positions, meta):
        model.decode_stack = stack
        assert decode_stack.applies(meta, model.model.embed_tokens(step_ids), caches)
        got = model(step_ids, positions, caches, meta)
        model.decode_stack = None
        hidden.append((got, model(step_ids, positions, loop_caches, meta)))
        model.decode_stack = stack

    for i, n in enumerate(lengths):  # fresh prefills, one sequence each
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot(i, p) for p in range(n)]),
            query_start_loc=[0, n],
            seq_lens=[n],
            block_tables=table_tensor[i : i + 1],
            num_decodes=1 if n == 1 else 0,
            seq_lens_tensor=torch.tensor([n]),
            block_size=block_size,
        )
        if before_step is not None:
            before_step([(i, n)])
        both(ids[i][:n], torch.arange(n), meta)
    for s in range(steps):
        pos = [n + s for n in lengths]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot(i, p) for i, p in enumerate(pos)]),
            query_start_loc=list(range(len(lengths) + 1)),
            seq_lens=[p + 1 for p in pos],
            block_tables=table_tensor,
            num_decodes=len(lengths),
            seq_lens_tensor=torch.tensor([p + 1 for p in pos]),
            block_size=block_size,
        )
        if before_step is not None:
            before_step([(i, 1) for i in range(len(lengths))])
        both(torch.stack([ids[i][p] for i, p in enumerate(pos)]), torch.tensor(pos), meta)
    return hidden, caches, loop_caches


def assert_stack_equals_loop(model, lengths: list[int], steps: int) -> None:
    assert model.decode_stack is not None and decode_stack.supports(model) is None
    hidden, caches, loop_caches = stack_and_loop(model, lengths, steps)
    assert len(hidden) == len(lengths) + steps
    for got, want in hidden:
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(caches, loop_caches))


@needs_amx
@pytest.mark.parametrize(
    "lengths",
    # 7 rows: the gemv's two passes over the codes; 9: the AMX tiles
    [
        [37],
        [5, 70],
        [16, 1, 33],
        [64, 17, 2, 40],
        [3, 9, 18, 30, 41, 50, 7],
        [4, 8, 15, 16, 23, 42, 6, 2, 11],
    ],
)
def test_stack_equals_the_layer_loop_on_the_default_gguf_model(gguf_model, lengths):
    assert_stack_equals_loop(gguf_model, lengths, steps=3)


@needs_prepacking
@pytest.mark.parametrize("lengths", [[37], [16, 1, 33], [3, 9, 18, 30, 41, 50, 7]])
def test_stack_equals_the_layer_loop_on_the_default_bf16_model(bf16_model, lengths):
    assert_stack_equals_loop(bf16_model, lengths, steps=2)


@needs_prepacking
def test_stack_equals_the_layer_loop_on_bf16_qwen2_with_bias(tiny_qwen2_path):
    assert_stack_equals_loop(fused(tiny_qwen2_path, None), [9, 20, 3, 5, 11], steps=2)


@needs_amx
@pytest.mark.parametrize("which", ["qwen2 int4", "llama int8"])
@pytest.mark.parametrize("lengths", [[9, 20, 3], [4, 8, 12, 16, 20, 24]])
def test_stack_equals_the_layer_loop_on_other_shapes(which, lengths, tiny_qwen2_int4, tiny_llama_int8):
    assert_stack_equals_loop(tiny_qwen2_int4 if which == "qwen2 int4" else tiny_llama_int8, lengths, steps=2)


@needs_amx
def test_engine_greedy_outputs_are_the_same_without_the_stack():
    llm = LLM(quantization="gguf", show_progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert llm.llm_engine.model.decode_stack is not None
    with_stack = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.llm_engine.model.decode_stack = None
    llm.reset_prefix_cache()
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_stack == without


def test_stack_is_built_only_for_models_it_can_run(gguf_model, bf16_model, tiny_qwen2_path):
    fp32, _ = build_model(tiny_qwen2_path, torch.float32, show_progress=False)
    fuse_for_inference(fp32)
    assert fp32.decode_stack is None  # unquantized fp32 linears (MKL): the layer loop
    reason = decode_stack.supports(fp32)
    assert reason is not None
    if STACK is not None:  # the stack is here; the model's linears are what it cannot call
        assert reason.startswith("layer 0 qkv_proj is a Linear"), reason
    if AMX is None and AVX2 is None:  # quantized layers without a kernel layout: the loop
        assert gguf_model.decode_stack is None
    if not PREPACKED:
        assert bf16_model.decode_stack is None
    for model in (fp32, gguf_model, bf16_model):  # built exactly where supports() finds no reason
        assert (model.decode_stack is None) == (decode_stack.supports(model) is not None)


def test_stack_steps_aside_for_mixed_and_chunked_steps_and_quantized_caches():
    cache = torch.zeros(2, 4, 16, 3, 64, dtype=BF16)

    def meta(new_tokens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        starts = [0]
        for n in new_tokens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.long),
            num_decodes=sum(n == 1 for n in new_tokens),
            seq_lens_tensor=torch.tensor(seq_lens),
        )

    def x(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 576, dtype=BF16)

    assert decode_stack.applies(meta([1] * 4, [9, 3, 5, 7]), x(4), [cache])  # decodes
    assert decode_stack.applies(meta([1] * 32, [9] * 32), x(32), [cache])
    assert decode_stack.applies(meta([12], [12]), x(12), [cache])  # one fresh prefill
    assert not decode_stack.applies(meta([1, 12], [9, 12]), x(13), [cache])  # decodes and a prefill
    assert not decode_stack.applies(meta([5, 7], [5, 7]), x(12), [cache])  # two prefills
    assert not decode_stack.applies(meta([12], [40]), x(12), [cache])  # a chunk after a cached prefix
    assert not decode_stack.applies(meta([1], [9]), x(1), [cache.to(torch.float32)])
    assert not decode_stack.applies(meta([1], [9]), x(1), [object()])  # a QuantizedKVCache


# --- the AVX2 tier: AVX2-layout linears (the int8-activation kernel), float32 and bf16 activations ---

# 1, 3 and 32 sequences, each prefilled fresh (a length-1 one is a decode), then decoded together
AVX2_LENGTHS = [[37], [16, 1, 33], [(11 * i) % 53 + 1 for i in range(32)]]


@pytest.fixture(scope="module")
def gguf_model_fp32():
    return fused(default_model_path(), "gguf", FP32)


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama_fp32"))


def assert_avx2_stack(model) -> None:
    linear = model.model.layers[0].self_attn.qkv_proj
    # fuse_for_inference packed it for the model's activations
    assert linear.kernel is not None and linear.kernel.name == "avx2"
    assert linear.layout and linear.qweight is None
    assert model.decode_stack is not None and decode_stack.supports(model) is None


@needs_avx2
@pytest.mark.parametrize("lengths", AVX2_LENGTHS, ids=["1 seq", "3 seqs", "32 seqs"])
def test_avx2_stack_equals_the_layer_loop_on_the_default_gguf_model_fp32(gguf_model_fp32, lengths):
    assert_avx2_stack(gguf_model_fp32)
    assert_stack_equals_loop(gguf_model_fp32, lengths, steps=2)


@needs_avx2
@pytest.mark.parametrize("which", ["llama", "qwen2"])
@pytest.mark.parametrize("lengths", AVX2_LENGTHS, ids=["1 seq", "3 seqs", "32 seqs"])
def test_avx2_stack_equals_the_layer_loop_on_tiny_int4_fp32(which, lengths, tiny_llama_path, tiny_qwen2_path):
    model = fused(tiny_llama_path if which == "llama" else tiny_qwen2_path, "int4", FP32)
    assert_avx2_stack(model)
    assert_stack_equals_loop(model, lengths, steps=3)


@needs_avx2
@pytest.mark.skipif(AMX is not None, reason="bf16 takes the AMX layout on this CPU (tested above)")
def test_avx2_stack_equals_the_layer_loop_on_the_default_gguf_model_bf16(gguf_model):
    assert_avx2_stack(gguf_model)
    assert_stack_equals_loop(gguf_model, [16, 1, 33], steps=2)


@needs_avx2
@pytest.mark.parametrize("feature", ["architecture", "q_norm"])
def test_a_model_feature_the_stack_lacks_gets_the_layer_loop(feature, tiny_llama_path):
    model, _ = build_model(tiny_llama_path, FP32, "int4", show_progress=False)
    if feature == "architecture":
        model.config.architecture = "gemma"
    else:
        model.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    fuse_for_inference(model)
    assert model.decode_stack is None
    reason = decode_stack.supports(model)
    assert ("'gemma'" if feature == "architecture" else "layer 1 self_attn has q_norm") in reason, reason
    cfg = model.config
    cache = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(16, 21),
        query_start_loc=[0, 5],
        seq_lens=[5],
        block_tables=torch.tensor([[1]]),
        num_decodes=0,
        seq_lens_tensor=torch.tensor([5]),
        block_size=16,
    )
    hidden = model(torch.arange(3, 8), torch.arange(5), cache, meta)
    assert hidden.shape == (5, cfg.hidden_size) and torch.isfinite(hidden).all()


@needs_avx2
@pytest.mark.parametrize("lengths", AVX2_LENGTHS, ids=["1 seq", "3 seqs", "32 seqs"])
def test_avx2_stack_takes_projections_that_cannot_merge(lengths, tiny_llama_path):
    """A GGUF Q4_K_M file mixes types in a layer (Q6_K attn_v beside Q4_K q and k), so fuse.py cannot merge
    them into one matmul: the stack calls the parts and concatenates, as the layer loop does, bit for bit."""
    from pagedllm.quantization.linear import QuantLinear
    from pagedllm.quantization.rtn import rtn_quantize_weight

    model, _ = build_model(tiny_llama_path, FP32, "int4", show_progress=False)
    for layer, name in ((model.model.layers[0].self_attn, "v_proj"), (model.model.layers[1].mlp, "up_proj")):
        old = getattr(layer, name)
        w = old.dequantize_weight(torch.float32)
        setattr(layer, name, QuantLinear.from_quantized(rtn_quantize_weight(w, 8, 32), name=name))  # 8-bit
    fuse_for_inference(model)
    assert model.model.layers[0].self_attn.qkv_proj is None and model.model.layers[1].mlp.gate_up_proj is None
    assert model.model.layers[1].self_attn.qkv_proj is not None  # the other layers merge as before
    assert model.decode_stack is not None and decode_stack.supports(model) is None
    assert_stack_equals_loop(model, lengths, steps=3)


@needs_avx2
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_stack_adds_lora_adapters_as_the_layer_loop_does(dtype, tmp_path):
    """The default GGUF model with LoRA adapters (lora/manager.py attaches the LoRALinears' buffers to the
    stack): prefills and decode steps mixing two adapters and the base give the layer loop's hidden states
    and caches bit for bit (both add the adapters with the `lora` op's C++ code), and the adapters change
    them (the stack does add them)."""
    from lora_helpers import write_random_adapter

    from pagedllm.lora.manager import LoRAModelManager
    from pagedllm.lora.request import LoRAConfig, LoRARequest

    if ops.kernel("lora") is None:
        pytest.skip("no C++ lora op here: the stack runs only steps without adapter rows")
    model, cfg = build_model(default_model_path(), dtype, "gguf", show_progress=False)
    fuse_for_inference(model)
    plain = [h for h, _ in stack_and_loop(model, [9, 1, 20], 3)[0]]
    manager = LoRAModelManager(model, cfg, LoRAConfig(max_loras=2, max_lora_rank=8), dtype)
    assert model.decode_stack is not None
    modules = {
        layer: ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"] for layer in range(cfg.num_layers)
    }
    for i in (1, 2):
        folder = write_random_adapter(tmp_path / f"a{i}", cfg, 4 * i, modules, scale=0.2, seed=i)
        manager.add_adapter(LoRARequest(f"a{i}", i, str(folder)))
    adapter_of = [1, 0, 2]  # sequence -> lora_int_id (0: the base)
    hidden, caches, loop_caches = stack_and_loop(
        model,
        [9, 1, 20],
        3,
        before_step=lambda rows: manager.set_batch([(adapter_of[i], n) for i, n in rows]),
    )
    for got, want in hidden:
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(caches, loop_caches))
    assert torch.equal(hidden[1][0], plain[1])  # the base sequence's prefill: nothing added
    assert not torch.equal(hidden[0][0], plain[0]) and not torch.equal(hidden[2][0], plain[2])
