"""How GGUF lays out Llama weights differently from Hugging Face checkpoints.

A bottom-layer module: both the GGUF loader (model/loader/gguf.py, which dequantizes) and the
GGUF-native quantized linears (quantization/gguf_native.py, which keep the blocks) undo the same
permutation, and neither should import the other to get it. numpy only.
"""

from __future__ import annotations

import numpy as np


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation (it interleaves the two rotary halves per head).

    The converter does `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`, so the inverse
    reads rows as (n_head, rows // n_head // 2, 2) and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
