"""Issue 37's LoRA benchmark (not a test): W32 throughput with 32 requests spread over 8 rank-R adapters
(all seven linears) against the base model's W32 without --enable-lora (output tokens a second, prefills
included), and single-stream decode with an adapter against without (the tokens after the first over the time
after the first); one process, runs interleaved, medians.

    .venv/bin/python scripts/bench_lora.py [--model default] [--rank 16] [--adapters 8] [--repeat 3]

The adapters are random PEFT folders of the model's shapes, written to a temporary folder (no download).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.peft import TARGETS, module_shapes


def write_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in module_shapes(cfg).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def tok_per_s(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> float:
    """Output tokens a second over the whole run (prefills included)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def decode_tok_per_s(llm: LLM, prompt: list[int], params: SamplingParams, lora) -> float:
    """One stream's decode speed: the tokens after the first over the time after the first (as `bench
    throughput` reports single50's decode; the prompt's prefill is left out)."""
    out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    common = dict(max_num_seqs=32, kv_cache_memory="512MiB", show_progress=False)
    base = LLM(model=args.model, **common)
    lora = LLM(model=args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    cfg = lora.llm_engine.model_config
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, cfg.vocab_size - 100, (args.input_len,), generator=g).tolist() for _ in range(32)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        requests = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i)))
            for i in range(args.adapters)
        ]
        spread = [requests[i % args.adapters] for i in range(32)]
        runs = {
            "W32 base (no --enable-lora)": lambda: tok_per_s(base, prompts, params, None),
            f"W32 over {args.adapters} rank-{args.rank} adapters": lambda: tok_per_s(
                lora, prompts, params, spread
            ),
            "single decode, base (no --enable-lora)": lambda: decode_tok_per_s(base, prompts[0], params, None),
            "single decode with an adapter": lambda: decode_tok_per_s(lora, prompts[0], params, requests[0]),
        }
        for run in runs.values():  # warm-up: every adapter loaded, every kernel path taken once
            run()
        figures: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, run in runs.items():
                figures[name].append(run())
    med = {name: statistics.median(v) for name, v in figures.items()}
    for name, value in med.items():
        print(f"{name:40s} {value:8.1f} tok/s  (runs: {', '.join(f'{v:.1f}' for v in figures[name])})")
    names = list(med)
    print(
        f"W32 ratio {med[names[1]] / med[names[0]]:.2f}x, single-stream ratio {med[names[3]] / med[names[2]]:.2f}x"
    )


if __name__ == "__main__":
    main()
