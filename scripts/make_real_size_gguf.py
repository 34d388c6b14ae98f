"""Random-weight GGUF files of the shapes people serve (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B), with the
default model's SmolLM2 tokenizer and chat template, for the real-size benchmarks (issue 34).

    .venv/bin/python scripts/make_real_size_gguf.py --shape 1b --type Q4_0 --out /tmp/llama1b-q4_0.gguf
    .venv/bin/python scripts/make_real_size_gguf.py --shape 1b --type F16 --out /tmp/llama1b-f16.gguf
    ~/.cache/pagedllm/llama.cpp/0.3.36/bin/llama-quantize /tmp/llama1b-f16.gguf /tmp/llama1b-q4_k_m.gguf Q4_K_M

F16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are written with the `gguf` package; K-quants need llama.cpp's
llama-quantize (scripts/build_llama_server.sh builds it beside llama-server) from an F16 file. Weights are
normal with std 0.02 (norms 1): the text is noise, the arithmetic and the bytes read per token are real.
Tensors are written one at a time, so an 8B F16 file needs ~1 GB of memory, not 16.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tqdm import tqdm

from pagedllm.model.loader import default_model_path
from pagedllm.model.loader.gguf import read_gguf_header

# name: (layers, hidden, heads, kv heads, ffn, tied embeddings)
SHAPES = {
    "1b": (16, 2048, 32, 8, 8192, True),
    "3b": (28, 3072, 24, 8, 8192, True),
    "8b": (32, 4096, 32, 8, 14336, False),
}
VOCAB = 49152  # SmolLM2's tokenizer (the default model's), so the engine and llama.cpp read one vocabulary
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def tensors(shape: str):
    """(gguf name, numpy shape rows-first, is a norm) of every tensor of the model."""
    layers, d, heads, kv_heads, ffn, tied = SHAPES[shape]
    head_dim = d // heads
    yield "token_embd.weight", (VOCAB, d), False
    for i in range(layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (d,), True
        yield p + "attn_q.weight", (heads * head_dim, d), False
        yield p + "attn_k.weight", (kv_heads * head_dim, d), False
        yield p + "attn_v.weight", (kv_heads * head_dim, d), False
        yield p + "attn_output.weight", (d, heads * head_dim), False
        yield p + "ffn_norm.weight", (d,), True
        yield p + "ffn_gate.weight", (ffn, d), False
        yield p + "ffn_up.weight", (ffn, d), False
        yield p + "ffn_down.weight", (d, ffn), False
    yield "output_norm.weight", (d,), True
    if not tied:
        yield "output.weight", (VOCAB, d), False


def write(shape: str, qtype: GGMLQuantizationType, out: Path, seed: int) -> None:
    layers, d, heads, kv_heads, ffn, _ = SHAPES[shape]
    source = read_gguf_header(default_model_path(), with_tensors=False).metadata
    w = GGUFWriter(str(out), "llama")
    w.add_name(f"random-llama-{shape}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // heads)
    w.add_vocab_size(VOCAB)
    w.add_file_type({"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}[qtype.name])
    for key in TOKENIZER_KEYS:
        value = source[key]
        if key == "tokenizer.ggml.token_type":
            w.add_token_types([int(t) for t in value])
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    rng = np.random.default_rng(seed)
    specs = list(tensors(shape))
    for name, tshape, norm in specs:  # the header first: the data then streams tensor by tensor
        t = qtype if not norm else GGMLQuantizationType.F32
        nbytes = quantized_nbytes(tshape, t)
        w.add_tensor_info(name, tshape, np.dtype(np.float32), nbytes, t)  # the logical shape (not bytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, tshape, norm in tqdm(specs, desc=f"writing {out.name}"):
        if norm:
            data = np.ones(tshape, dtype=np.float32)
        else:
            data = (rng.standard_normal(tshape, dtype=np.float32) * 0.02).astype(np.float32)
            data = data.astype(np.float16) if qtype == GGMLQuantizationType.F16 else quantize(data, qtype)
        w.write_tensor_data(data)
    w.close()


def quantized_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // block * size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", default="Q4_0", choices=["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.shape, GGMLQuantizationType[args.type], args.out, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
