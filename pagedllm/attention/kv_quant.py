"""A quantized paged KV cache: int8 or fp8 (e4m3) codes with one scale per token and KV head.

Layout mirrors the float cache, [2, num_blocks, block_size, kv_heads, head_dim] codes, plus
[2, num_blocks, block_size, kv_heads] float32 scales, so block tables, copy-on-write and slot mapping
work unchanged. Scales are symmetric (absmax): K and V are centred near zero and a per-token,
per-head scale follows their range closely, so no zero point is needed. Values are quantized when
written and dequantized when read; a prompt's own prefill attends to its fresh, unquantized K/V.

It lives with attention, not quantization: it is a cache layout the attention backend reads and writes,
and it needs nothing from the weight quantizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.errors import InputError

# code dtype and the largest magnitude it holds
KV_QUANT_DTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
# float caches; "auto" = the model's compute dtype
FLOAT_KV_DTYPES = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SCALE_BYTES = 4  # float32 scale per token and KV head, for K and for V


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | str:
    """A torch dtype for a float cache, or "int8" / "fp8" for a quantized one; InputError otherwise."""
    if name in KV_QUANT_DTYPES:
        return name
    if name not in FLOAT_KV_DTYPES:
        raise InputError(
            f"kv_cache_dtype must be one of {', '.join([*FLOAT_KV_DTYPES, *KV_QUANT_DTYPES])}; got {name!r}",
            param="kv_cache_dtype",
        )
    return FLOAT_KV_DTYPES[name] or model_dtype


@dataclass
class QuantizedKVCache:
    data: torch.Tensor  # [2, num_blocks, block_size, kvh, hd] int8 / float8_e4m3fn
    scale: torch.Tensor  # [2, num_blocks, block_size, kvh] float32
    kind: str

    @classmethod
    def zeros(cls, kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        dtype, _ = KV_QUANT_DTYPES[kind]
        data = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        scale = torch.ones(2, num_blocks, block_size, num_kv_heads, dtype=torch.float32)
        return cls(data, scale, kind)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def raw(self) -> torch.Tensor:
        # torch's CPU index kernels do not take float8: move its bytes as uint8 (same size, same bits)
        return self.data.view(torch.uint8) if self.kind == "fp8" else self.data

    def _dequantize(self, raw_codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = raw_codes.view(self.data.dtype)
        return (codes.float() * scale.unsqueeze(-1)).to(dtype)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kvh, hd = self.data.shape[-2:]
        raw = self.raw
        for i, x in enumerate((k, v)):
            codes, scale = quantize_kv(x, self.kind)
            raw[i].view(-1, kvh, hd).index_copy_(0, slot_mapping, codes.view(raw.dtype))
            self.scale[i].view(-1, kvh).index_copy_(0, slot_mapping, scale)

    def read_blocks(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, len(block_ids), block_size, kvh, hd] dequantized."""
        codes = torch.index_select(self.raw, 1, block_ids)
        return self._dequantize(codes, torch.index_select(self.scale, 1, block_ids), dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raw = self.raw
        raw[:, dst] = raw[:, src]
        self.scale[:, dst] = self.scale[:, src]


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, kvh, hd] -> codes [T, kvh, hd], scales [T, kvh] (absmax per token and head)."""
    dtype, qmax = KV_QUANT_DTYPES[kind]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # all-zero rows stay exactly zero
    y = x / scale.unsqueeze(-1)
    codes = y.round().clamp(-qmax, qmax).to(dtype) if dtype == torch.int8 else y.clamp(-qmax, qmax).to(dtype)
    return codes, scale


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kind: str) -> int:
    """K and V codes (one byte each) plus their float32 scales, per token, all layers."""
    return 2 * num_layers * num_kv_heads * (head_dim + SCALE_BYTES)
