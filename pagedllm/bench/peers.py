"""The tools people use today, run on the same prompts in the same process for a fair ratio.

HF transformers: `generate` on a left-padded static batch (how most people batch with it).
Nothing here is imported by the engine.
"""

from __future__ import annotations

import time

import torch

from pagedllm.bench.dataset import BenchPrompt


def hf_generate_throughput(
    model_path, prompts: list[BenchPrompt], dtype: torch.dtype, batch_size: int = 32
) -> dict:
    """Greedy, ignore-EOS generation with transformers; returns elapsed seconds and token counts."""
    import transformers

    from pagedllm.model.tokenizer import Tokenizer

    if model_path.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    tok = Tokenizer.from_checkpoint(model_path)
    ids = [p.prompt if isinstance(p.prompt, list) else tok.encode(p.prompt) for p in prompts]
    pad = tok.eos_token_id or 0
    out_tokens = 0
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        chunk, params = ids[b : b + batch_size], prompts[b : b + batch_size]
        width = max(len(x) for x in chunk)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        n = max(p.max_tokens for p in params)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        out_tokens += sum(p.max_tokens for p in params)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_time": elapsed,
        "num_requests": len(ids),
        "prompt_tokens": sum(map(len, ids)),
        "output_tokens": out_tokens,
    }
