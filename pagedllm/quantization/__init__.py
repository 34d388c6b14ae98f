"""Quantization: the spec's uniform quantizer (uniform.py), INT4 packing (pack.py), exact explain (explain.py).

Names are loaded on first use so that `pagedllm quant explain` (pure Fractions) does not import torch.
"""

import importlib

_EXPORTS = {
    "QuantizedTensor": "uniform",
    "quantize": "uniform",
    "dequantize": "uniform",
    "fake_quantize": "uniform",
    "pack_int4": "pack",
    "unpack_int4": "pack",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
