"""GGUF files: metadata -> ModelConfig, tensors -> float32 weights with Hugging Face Llama names.

The header (key/values and tensor infos) is parsed here with `struct` because gguf.GGUFReader builds a
numpy view per vocabulary string (~2.5 s for a 49k vocab); the tensor bytes are memory-mapped and
dequantized by `gguf.quants.dequantize`, so the block formats stay the gguf package's business.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.gguf_layout import unpermute_qk
from pagedllm.model.loader import moe, registry
from pagedllm.model.loader.hf_config import check_complete, split_fused
from pagedllm.platform import release_free_heap

GGUF_MAGIC = b"GGUF"
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}

# llama.cpp tensor names -> HF names: the registry's table (one for every family)
_GLOBAL_NAMES = registry.GGUF_GLOBAL_NAMES
_LAYER_NAMES = registry.GGUF_LAYER_NAMES
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed): rows first
    type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


def _corrupt(path: Path, why: str) -> InputError:
    return InputError(f"truncated or corrupt GGUF file {path}: {why}", param="model")


class _Cursor:
    """Sequential little-endian reader over a bytes-like buffer; raises InputError past the end."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _corrupt(self.path, f"needs {n} bytes at offset {self.pos}, file has {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 128K of them in Llama-3's), read in one loop: string()
        a time cost ~1 s for a 49K-token vocabulary."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.take(8)  # raises: truncated
            (n,) = length(buf, pos)
            if pos + 8 + n > end:
                self.pos = pos + 8
                self.take(n)
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()
            if etype == 8:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise _corrupt(self.path, f"unknown value type {vtype} at offset {self.pos}")


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_header(path: str | Path, with_tensors: bool = True) -> GGUFHeader:
    """Parse the key/values (and tensor infos) of a GGUF file without touching tensor data."""
    path = Path(path)
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    cur = _Cursor(memoryview(data), path)
    if bytes(cur.take(4)) != GGUF_MAGIC:
        raise InputError(f"{path} is not a GGUF file (no GGUF magic)", param="model")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise _corrupt(path, f"unsupported GGUF version {version} (expected 2 or 3, little-endian)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    tensors: list[GGUFTensorInfo] = []
    if not with_tensors:
        return GGUFHeader(metadata, tensors)
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        raw_infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    for name, dims, type_id, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise _corrupt(path, f"tensor {name} has unknown ggml type {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise _corrupt(
                path, f"tensor {name} row of {dims[0]} is not a multiple of {qtype.name} block {block}"
            )
        nbytes = n_elements // block * type_size
        start = data_start + offset
        if start + nbytes > len(data):
            raise _corrupt(path, f"tensor {name} ends at byte {start + nbytes}, file has {len(data)}")
        # ggml lists the fastest-varying dimension first; numpy wants it last.
        tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes))
    return GGUFHeader(metadata, tensors)


def _get(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise InputError(f"GGUF file {path} lacks metadata field {key}", param="model")
    return meta[key]


def gguf_model_config(meta: dict[str, Any], tensors: list[GGUFTensorInfo], path: Path) -> ModelConfig:
    entry = registry.from_gguf(meta.get("general.architecture"), str(path), meta)  # Mixtral: llama + experts
    registry.check_gguf_features(entry, meta, str(path))
    arch = entry.gguf_architecture
    d_model = int(_get(meta, f"{arch}.embedding_length", path))
    n_heads = int(_get(meta, f"{arch}.attention.head_count", path))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    # key_length is the real head size; rope.dimension_count can be partial rotary, so it comes second
    # (and not at all for a family with partial rotary, where it is the rotary width: Phi-4-mini)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    head_dim = int(
        meta.get(f"{arch}.attention.key_length")
        or (None if entry.partial_rotary else rope_dims)
        or d_model // n_heads
    )
    rotary_dim = None
    # only a family with partial rotary reads it as such (others keep whole-head rotary, as before)
    if entry.partial_rotary and rope_dims and int(rope_dims) != head_dim:
        if int(rope_dims) % 2 or int(rope_dims) > head_dim:
            raise InputError(
                f"GGUF file {path}: {arch}.rope.dimension_count={rope_dims} of {head_dim}-dim heads "
                f"(partial rotary) is not supported for {arch}",
                param="model",
            )
        rotary_dim = int(rope_dims)
    if any(t.name.startswith("rope_factors_") for t in tensors) or (
        meta.get(f"{arch}.rope.scaling.type") == "longrope"
    ):
        # LongRoPE factors stored as tensors (rope_factors_long/short): not read from GGUF yet
        raise InputError(
            f"GGUF file {path}: LongRoPE (rope_factors_long/short, rope_scaling.type 'longrope') is not "
            "supported in GGUF files; load the Hugging Face folder instead",
            param="model",
        )
    # vocab_size is often absent: fall back to the embedding's rows (the tokenizer may be shorter).
    shapes = {t.name: t.shape for t in tensors}
    vocab = meta.get(f"{arch}.vocab_size") or shapes.get("token_embd.weight", (None,))[0]
    if vocab is None:
        raise InputError(
            f"GGUF file {path} has neither {arch}.vocab_size nor token_embd.weight", param="model"
        )
    rope_scaling = None
    stype = meta.get(f"{arch}.rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(meta[key]) not in eos_ids:
            eos_ids.append(int(meta[key]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    n_layers = int(_get(meta, f"{arch}.block_count", path))
    max_pos = int(meta.get(f"{arch}.context_length", 2048))
    window, layer_types = _sliding_window(entry, meta, n_layers, max_pos, path)
    gemma = entry.gemma
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=d_model,
        intermediate_size=int(_get(meta, f"{arch}.feed_forward_length", path)),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in shapes,  # no separate output matrix: tied
        # the family's q/k/v bias, or biases the file simply has
        attention_bias=entry.qkv_bias or "blk.0.attn_q.bias" in shapes,
        o_proj_bias="blk.0.attn_output.bias" in shapes,
        qk_norm=entry.qk_norm,
        qk_norm_full=entry.qk_norm_full,
        **moe.gguf_moe_fields(entry, meta, set(shapes), n_layers, path),
        rotary_dim=rotary_dim,
        sliding_window=window,
        layer_types=layer_types,
        # llama.cpp's Gemma 3: 10000 for the sliding layers unless the file says
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        if entry.local_rope_base
        else None,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        gemma_norms=gemma,
        attn_logit_softcapping=_positive(meta.get(f"{arch}.attn_logit_softcapping")) if gemma else None,
        final_logit_softcapping=_positive(meta.get(f"{arch}.final_logit_softcapping")) if gemma else None,
        query_pre_attn_scalar=_gemma_query_scalar(entry, d_model, n_heads, head_dim, n_layers),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        architecture=entry.name,
    )


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _sliding_window(
    entry: registry.Architecture, meta: dict[str, Any], n_layers: int, max_pos: int, path: Path
) -> tuple[int | None, list[str] | None]:
    """{arch}.attention.sliding_window over the layers {arch}.attention.sliding_window_pattern marks (an
    int: every n-th layer global; or one bool per layer, true = windowed), else the family's rule, as
    llama.cpp applies it; (None, None) where no window slides within the context."""
    arch = entry.gguf_architecture
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window or entry.sliding_layers in ("none", "max_window_layers"):
        return None, None  # llama.cpp runs Qwen2/3 and Llama-arch files without windows
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        pattern = entry.sliding_window_pattern if entry.sliding_layers == "pattern" else None
    if pattern is None:
        types = ["sliding_attention"] * n_layers
    elif isinstance(pattern, (int, np.integer)):
        types = registry.pattern_layer_types(n_layers, int(pattern))
    else:
        marks = [bool(x) for x in pattern]
        if len(marks) != n_layers:
            raise InputError(
                f"GGUF file {path}: {arch}.attention.sliding_window_pattern has {len(marks)} entries for "
                f"{n_layers} layers",
                param="model",
            )
        types = ["sliding_attention" if m else "full_attention" for m in marks]
    if int(window) >= max_pos or "sliding_attention" not in types:
        return None, None
    return int(window), types


# Gemma's 27B models scale attention by hidden / heads rather than head_dim (query_pre_attn_scalar); GGUF
# has no key for it, so llama.cpp tells them by their layer count, and so does this
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_query_scalar(
    entry: registry.Architecture, d_model: int, n_heads: int, head_dim: int, n_layers: int
) -> float | None:
    if not entry.gemma:
        return None
    if _GEMMA_27B_LAYERS.get(entry.gguf_architecture) == n_layers:
        return float(d_model // n_heads)
    return float(head_dim)


def read_gguf_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    header = read_gguf_header(path)
    return gguf_model_config(header.metadata, header.tensors, path)


def hf_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str | None:
    """llama.cpp tensor name -> HF Llama name (a family's own table: registry.gguf_layer_names); None for
    tensors we do not use (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    return None


def dequantize_tensor(path: Path, info: GGUFTensorInfo, raw: np.ndarray) -> np.ndarray:
    if info.type not in SUPPORTED_TYPES:
        raise InputError(
            f"GGUF file {path}: tensor {info.name} has unsupported type {info.type.name} "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})",
            param="model",
        )
    return dequantize(raw, info.type).reshape(info.shape).astype(np.float32, copy=False)


def drop_file_pages(raw: np.ndarray) -> None:
    """Give back what building one tensor from `raw` left resident: the memory-mapped file's pages
    (MADV_DONTNEED: they stay in the page cache, and a later read faults them back in; the file is read
    once, so its 640 MB for a 1B Q4_K_M need not count beside the layouts made from them) and the heap the
    decoding freed (malloc_trim: glibc keeps freed blocks under its mmap threshold, which grows to 32 MB
    after the first big free, so a 1B file's load left ~800 MB of free heap resident)."""
    mapping = getattr(raw, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)
    release_free_heap()


def raw_tensor(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as gguf.quants expects them: uint8 rows of whole blocks, or the float dtype."""
    raw = data[info.offset : info.offset + info.nbytes]
    if info.type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.type == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape)
    block, type_size = GGML_QUANT_SIZES[info.type]
    return raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)


def _split_fused_raw(
    quantized: dict[str, tuple[str, np.ndarray, tuple[int, ...]]], config: ModelConfig
) -> None:
    """split_fused on the raw blocks: rows [q; k; v] and [gate; up] (the sizes hf_config.split_fused checks)."""
    q, kv, f = config.num_heads * config.head_dim, config.kv_width, config.intermediate_size
    for name in [n for n in quantized if n.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
        qtype, raw, shape = quantized.pop(name)
        prefix = name.rsplit(".", 2)[0]
        if ".qkv_proj." in name:
            sizes, parts = (q, kv, kv), ("q_proj", "k_proj", "v_proj")
        else:
            sizes, parts = (f, f), ("gate_proj", "up_proj")
        start = 0
        for part, rows in zip(parts, sizes):
            quantized[f"{prefix}.{part}.weight"] = (qtype, raw[start : start + rows], (rows, *shape[1:]))
            start += rows


# the linears whose weights may be served from their blocks without a float copy (quantization/gguf_native.py
# replaces exactly these, one tensor each; fused and expert tensors are split as floats first)
# what a quantized kernel serves from its blocks: the linears, and the token embedding (QuantEmbedding looks
# its rows up from the blocks; with tied embeddings the same blocks are the lm_head)
_SERVABLE = re.compile(r"(\.(q|k|v|o|gate|up|down)_proj|^lm_head|^model\.embed_tokens)\.weight$")


def load_gguf(
    path: str | Path,
    show_progress: bool = True,
    keep_quantized: bool = False,
    served_types: Collection[str] = (),
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, tuple[str, np.ndarray, tuple[int, ...]]] | None]:
    """Returns (config, float32 weights with HF names, raw quantized tensors when keep_quantized).

    A linear weight whose type is in served_types is not dequantized (no float copy is ever made: a 1B
    Q4_0 file's float32 weights alone are 4 GiB): it comes back only as raw blocks, for the caller to serve."""
    path = Path(path)
    header = read_gguf_header(path)
    config = gguf_model_config(header.metadata, header.tensors, path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[str, np.ndarray, tuple[int, ...]]] | None = {} if keep_quantized else None
    if any(t.name == "rope_freqs.weight" for t in header.tensors):
        # Llama-3.1 style files store RoPE frequency factors as a tensor instead of rope_scaling keys;
        # they only matter past the original context length, so warn rather than refuse.
        warnings.warn(f"{path}: rope_freqs.weight (per-dimension RoPE factors) is ignored", stacklevel=2)
    entry = registry.get(config.architecture)
    layer_names = registry.gguf_layer_names(entry)
    served: set[str] = set()
    for info in tqdm(header.tensors, desc=f"loading {path.name}", disable=not show_progress, leave=False):
        name = hf_name(info.name, layer_names)
        if name is None:
            continue
        if name.endswith(".mlp.up_proj.weight") and info.shape[0] == 2 * config.intermediate_size:
            name = name.replace(".up_proj.", ".gate_up_proj.")  # Phi-3's ffn_up holds [gate; up]
        raw = raw_tensor(data, info)
        servable = len(info.shape) == 2 and ".experts." not in name and _SERVABLE.search(name)
        if quantized is not None and info.type.name in served_types and servable:
            quantized[name] = (info.type.name, raw, info.shape)
            served.add(name)
            continue
        w = dequantize_tensor(path, info, raw)
        # Only Llama-arch files are permuted by the converter; Qwen2 and Qwen3 keep HF's row order.
        permuted = registry.get(config.architecture).gguf_permuted_qk
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config.num_kv_heads)
        if entry.gemma and name.endswith("norm.weight"):
            w = w - 1.0  # convert_hf_to_gguf stores Gemma's norms as 1 + weight; the model adds the 1
        # require(W) copies the memory-mapped F32 tensors, which are read-only views of the file.
        weights[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
        if quantized is not None:
            # Raw blocks keep llama.cpp's Q/K row order: whoever uses them must unpermute too.
            quantized[name] = (info.type.name, raw, info.shape)
    if quantized is not None:  # ggml blocks run along rows: a fused tensor splits by rows as the floats do
        _split_fused_raw(quantized, config)
        moe.split_experts_raw(quantized, config, path)
    moe.split_experts(weights, config, path)  # ffn_{gate,up,down}_exps: [experts, out, in]
    split_fused(weights, config, path)  # Phi-3's attn_qkv and ffn_up
    # the served weights' shapes are checked too: meta tensors stand for them (no memory)
    check_complete(
        {**weights, **{n: torch.empty(quantized[n][2], device="meta") for n in served}}, config, path
    )
    return config, weights, quantized
