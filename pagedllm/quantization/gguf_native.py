"""Serve GGUF linear weights as stored: their blocks become QuantLinear codes + scales + mins.

Which types, and the exact arithmetic of each, is gguf_blocks.py's table: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K, each as codes with a float scale and min per 32 weights (16 for Q6_K: the group comes with
the decoded blocks) whose dequantization equals llama.cpp's bit for bit. The others are dequantized to
floats at load; `unserved` lists them and their cost, and build.py logs it as a warning.

What runs: the kernel the op table gives each layer (woq_kernels.py): the AVX2 kernel on every tier from
avx2 up (any type above: its codes are 4- or 8-bit, its groups 32, or 16 with 8-bit codes for Q6_K), the
AMX kernels for bf16 at the amx tier where they take the group. The token_embd lookup reads its rows from
the blocks (QuantEmbedding, where build.py asks for it); the lm_head (token_embd when tied) is served from
its blocks where a kernel takes it without dequantizing per call.

llama.cpp stores the rows of attn_q / attn_k permuted; rows are whole here (codes, scales and mins of a row
move together), so unpermuting them is exact.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tqdm import tqdm

from pagedllm.config import ModelConfig
from pagedllm.gguf_layout import unpermute_qk
from pagedllm.model.loader import registry
from pagedllm.model.loader.gguf import drop_file_pages
from pagedllm.quantization import gguf_blocks
from pagedllm.quantization.embedding import QuantEmbedding
from pagedllm.quantization.layout_cache import LayoutCache
from pagedllm.quantization.linear import QuantLinear

NATIVE_TYPES = gguf_blocks.NATIVE_TYPES


def _decode(type_name: str, raw: np.ndarray, shape: tuple[int, ...]):
    codes, scales, mins, bits, group = gguf_blocks.decode(type_name, raw, shape)
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), bits, group


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def unserved(
    gguf_tensors: dict[str, tuple[str, np.ndarray, tuple[int, ...]]], dtype: torch.dtype
) -> list[tuple[str, str, int]]:
    """The quantized tensors no kernel serves from their blocks (types outside NATIVE_TYPES: Q2_K, Q3_K,
    IQ*, ...), which the loader dequantizes: (name, type, bytes their `dtype` copy takes), biggest first."""
    size = torch.empty(0, dtype=dtype).element_size()
    rows = [
        (name, type_name, int(np.prod(shape)) * size)
        for name, (type_name, _, shape) in gguf_tensors.items()
        if type_name not in NATIVE_TYPES and type_name not in FLOAT_TYPES
    ]
    return sorted(rows, key=lambda r: -r[2])


def unserved_message(rows: list[tuple[str, str, int]]) -> str:
    """One line for the log: how many tensors, of which types, what they cost, the biggest named."""
    types = sorted({t for _, t, _ in rows})
    total = sum(b for _, _, b in rows) / 2**20
    names = ", ".join(f"{n} ({t})" for n, t, _ in rows[:3]) + (", ..." if len(rows) > 3 else "")
    return (
        f"GGUF: {len(rows)} tensors of type {', '.join(types)} have no kernel that serves them from their "
        f"blocks; they are dequantized at load: {total:.0f} MiB of floats ({names})"
    )


def decode_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, ...]):
    """Raw rows of blocks -> (codes uint8 [out, in], scales f32 [out, in/group], mins f32 [out, in/group],
    bits); the group is 32, 16 for Q6_K (gguf_blocks.BLOCKS[type_name][3])."""
    return _decode(type_name, raw, shape)[:4]


def gguf_quant_linear(
    name: str,
    type_name: str,
    raw: np.ndarray,
    shape: tuple[int, ...],
    config: ModelConfig,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> QuantLinear:
    """One HF-named linear (e.g. model.layers.0.self_attn.q_proj) from its raw GGUF blocks; with `dtype`,
    packed for activations of that dtype (QuantLinear.packed_from_codes)."""
    codes, scales, mins, bits, group = _decode(type_name, raw, shape)
    superblocks = gguf_blocks.super_blocks(type_name, raw, shape)
    if registry.get(config.architecture).gguf_permuted_qk and (".q_proj" in name or ".k_proj" in name):
        heads = config.num_heads if ".q_proj" in name else config.num_kv_heads

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(unpermute_qk(t.numpy(), heads).copy())

        codes, scales, mins = rows(codes), rows(scales), rows(mins)
        if superblocks is not None:
            sb = superblocks
            superblocks = type(sb)(
                sb.groups, rows(sb.d), rows(sb.scale_codes), rows(sb.dmin), rows(sb.min_codes)
            )
    if dtype is not None:
        return QuantLinear.packed_from_codes(codes, scales, mins, bits, group, dtype, superblocks, bias, name)
    layer = QuantLinear.from_codes(codes, scales, mins, bits, group, bias, name)
    layer.superblocks = superblocks
    return layer


# Weights a slice decodes and packs at a time: decoding and packing make several full-size transients
# (codes, their widening, the kernel's interleave), so a 49152 x 2048 Q6_K token_embd built whole peaked
# ~600 MB above its layout; in slices of ~8M weights the peak is a slice's.
SLICE_WEIGHTS = 1 << 23


def packed_gguf_linear(
    name: str,
    type_name: str,
    raw: np.ndarray,
    shape: tuple[int, ...],
    config: ModelConfig,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> QuantLinear:
    """gguf_quant_linear, packed for `dtype` activations; a big weight slice by slice of rows where the
    kernel's layout stacks (QuantLinear.stack_packed), each slice's file pages given back as it is built."""
    rows, cols = shape
    step = max(64, SLICE_WEIGHTS // cols // 64 * 64)  # whole row groups of every kernel (ROW_ALIGN)
    permuted = registry.get(config.architecture).gguf_permuted_qk and (".q_proj" in name or ".k_proj" in name)
    parts: list[QuantLinear] = []
    if rows > step and not permuted:  # q / k rows are unpermuted per head: those are built whole
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            part = gguf_quant_linear(name, type_name, raw[r0:r1], (r1 - r0, cols), config, dtype=dtype)
            drop_file_pages(raw)
            if part.kernel is None or not part.kernel.stacks_rows:
                parts = []  # this kernel's layout does not stack: build it whole
                break
            parts.append(part)
    # the slices stack where one kernel took them all (a last slice of another shape may take another kernel
    # than the whole weight would: then it is built whole too)
    if parts and QuantLinear.stacks(parts):
        return QuantLinear.stack_packed(parts, bias, name)
    layer = gguf_quant_linear(name, type_name, raw, shape, config, bias, dtype)
    drop_file_pages(raw)
    return layer


def prebuilt_linears(
    gguf_tensors: dict[str, tuple[str, np.ndarray, tuple[int, ...]]],
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    cache: LayoutCache | None = None,
    show_progress: bool = False,
) -> dict[str, torch.nn.Module]:
    """The modules the loader left as blocks only (load_gguf's served_types: no float copy was made), built
    and packed before the model's float modules are, so that no float copy of them ever exists; each takes
    its bias out of `weights`. The token embedding becomes a QuantEmbedding, and with tied embeddings its
    table is the lm_head too. With a `cache`, a layout found there is taken as it is (no block decoded)
    and one built is kept for it; show_progress: a bar while layouts are built (a first load: ~40 s for an
    8B file on 2 cores). {module name: module}."""
    modules: dict[str, torch.nn.Module] = {}
    found: dict[str, QuantLinear | None] = {}
    jobs = []
    for name, (type_name, raw, shape) in gguf_tensors.items():
        if not name.endswith(".weight") or name in weights:
            continue
        module = name.removesuffix(".weight")
        bias = weights.pop(module + ".bias", None)
        found[module] = cache.get(module, shape, bias) if cache else None
        if found[module] is None:
            jobs.append((module, type_name, raw, shape, config, dtype, bias))
    # Decoding and packing run in numpy and torch ops that release the GIL, much of it single-threaded:
    # one tensor a torch thread builds a 1B Q4_K_M file 1.9x as fast on 2 cores (10.8 -> 5.7 s). Each job
    # runs in a copy of this context: --batch-invariant's kernel choice (ops.batch_invariant) holds there too.
    bar = tqdm(
        total=len(jobs),
        desc="packing the weights for the kernels (once a file: the layout cache keeps them)"
        if cache
        else "packing the weights for the kernels",
        disable=not show_progress or not jobs,
        leave=False,
    )
    with bar, ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        futures = [pool.submit(contextvars.copy_context().run, packed_gguf_linear, *job) for job in jobs]
        for job, future in zip(jobs, futures, strict=True):
            found[job[0]] = future.result()
            bar.update()
            if cache:
                cache.put(job[0], found[job[0]])
    for module, layer in found.items():
        if module == "model.embed_tokens":
            modules[module] = _embedding(layer, dtype)
            if config.tie_word_embeddings and _serves_lm_head(layer):
                layer.name = "lm_head"  # one table, two uses: named for the matmul
                modules["lm_head"] = layer
            elif config.tie_word_embeddings:  # no kernel serves it: floats, one copy with a float embedding
                embedding = modules[module]
                modules["lm_head"] = _float_linear(layer, dtype, getattr(embedding, "weight", None))
        else:
            modules[module] = layer
    return modules


# The float copy of a token embedding below which the engine keeps one: a lookup from the blocks costs
# ~0.15 ms a step in torch ops (a 3% slower single-stream decode of the 135M default model, whose bf16 table
# is 54 MiB), while above it the floats are what count (a 1B Llama-3.2 shape's: 192 MiB; Llama-3's 128K
# vocabulary at 4096 wide: 1 GiB).
EMBEDDING_FLOAT_MAX_BYTES = 64 << 20


def _embedding(table: QuantLinear, dtype: torch.dtype) -> torch.nn.Module:
    """The token embedding over a GGUF table: looked up from its blocks (QuantEmbedding), or a float
    nn.Embedding where its float copy is small (EMBEDDING_FLOAT_MAX_BYTES)."""
    size = table.out_features * table.in_features * torch.empty(0, dtype=dtype).element_size()
    if size > EMBEDDING_FLOAT_MAX_BYTES:
        return QuantEmbedding(table, dtype)
    embedding = torch.nn.Embedding(table.out_features, table.in_features, device="meta")
    embedding.weight = torch.nn.Parameter(table.dequantize_weight(dtype), requires_grad=False)
    return embedding


def _serves_lm_head(layer: QuantLinear) -> bool:
    """Whether the layer's kernel multiplies a decode batch without dequantizing the whole table each call
    (the torch reference would rebuild vocab x hidden weights every step)."""
    return layer.kernel is not None and not layer.kernel.dequantizes_at(layer, 32)


def _float_linear(
    layer: QuantLinear, dtype: torch.dtype, weight: torch.nn.Parameter | None = None
) -> torch.nn.Linear:
    """The dequantized layer as a float nn.Linear (a tied lm_head where no kernel serves the blocks); with
    `weight` (a float embedding's, the same table), that parameter itself."""
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    linear.weight = (
        weight if weight is not None else torch.nn.Parameter(layer.dequantize_weight(dtype), False)
    )
    return linear


def serve_gguf_natively(
    model: torch.nn.Module,
    gguf_tensors: dict[str, tuple[str, np.ndarray, tuple[int, ...]]],
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """Replace the model's float linears whose GGUF type is served natively (gguf_blocks.NATIVE_TYPES: those
    the loader had to split as floats first, e.g. Phi-3's fused ones) and the lm_head; returns their names."""
    from pagedllm.quantization.model import linear_layer_names, set_module

    replaced = []
    for name in linear_layer_names(model):
        entry = gguf_tensors.get(name + ".weight")
        if entry is None or entry[0] not in NATIVE_TYPES:
            continue
        type_name, raw, shape = entry
        old = model.get_submodule(name)
        layer = gguf_quant_linear(name, type_name, raw, shape, config, old.bias)
        layer.pack(dtype)
        set_module(model, name, layer)
        replaced.append(name)
    # The lm_head (a tied one is token_embd, Q8_0 in the default model) from its blocks too, as llama.cpp
    # does, but only where a kernel takes it: the dequantize path would rebuild 28M weights every step.
    # Its AMX bf16 tiles equal the dequantized checkpoint's bf16 lm_head; only the summation order differs.
    entry = gguf_tensors.get("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    if entry is not None and entry[0] in NATIVE_TYPES and not isinstance(model.lm_head, QuantLinear):
        type_name, raw, shape = entry
        head = gguf_quant_linear("lm_head", type_name, raw, shape, config)
        head.pack(dtype)
        if _serves_lm_head(head):
            model.lm_head = head
            replaced.append("lm_head")
    return replaced
