"""The tools people use today, run on the same prompts in the same process for a fair ratio.

HF transformers: `generate` on a left-padded static batch (how most people batch with it), in the
engine's dtype. llama.cpp: see llamacpp.py. Nothing here is imported by the engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedllm.bench.dataset import BenchPrompt
from pagedllm.bench.roofline import model_bytes_per_token


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives (batch of one only).

    generate() calls put() once with the prompt, then once per new token.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def load_hf_model(model_path: Path, dtype: torch.dtype):
    import transformers

    if model_path.is_file():  # GGUF: dequantized to dense dtype weights, the same weights we run
        extra = {}
        if hasattr(transformers, "GgufConfig"):  # newer transformers would keep the blocks packed otherwise
            extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=dtype, **extra
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def hf_generate_throughput(
    model_path: Path,
    prompts: list[BenchPrompt],
    dtype: torch.dtype,
    batch_size: int = 32,
    repeat: int = 1,
    use_tqdm: bool = True,
) -> list[dict]:
    """Greedy, ignore-EOS generation with transformers, `repeat` times; one dict of counts per run.

    A batch of one also reports its TTFT (via a streamer) and decode tokens/s after the first token.
    """
    from pagedllm.model.tokenizer import Tokenizer

    load_start = time.perf_counter()
    model = load_hf_model(model_path, dtype)
    load_time_s = time.perf_counter() - load_start  # start to ready: the checkpoint read into the model
    bytes_per_token = model_bytes_per_token(model)  # dense `dtype` weights, counted as ours (roofline.py)
    tok = Tokenizer.from_checkpoint(model_path)
    ids = [p.prompt if isinstance(p.prompt, list) else tok.encode(p.prompt) for p in prompts]
    pad = tok.eos_token_id or 0

    def generate(chunk: list[list[int]], n: int, streamer=None) -> None:
        width = max(len(x) for x in chunk)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,  # ignore EOS: exactly n tokens, like ours
                do_sample=False,
                pad_token_id=pad,
                streamer=streamer,
            )

    generate(ids[:2], 2)  # warm-up (first-call costs), not timed
    runs = []
    for _ in range(repeat):
        out_tokens = 0
        timer = _FirstTokenTimer() if len(ids) == 1 else None
        bar = tqdm(total=len(ids), desc="HF transformers", unit="req", disable=not use_tqdm)
        start = time.perf_counter()
        for b in range(0, len(ids), batch_size):
            chunk, params = ids[b : b + batch_size], prompts[b : b + batch_size]
            generate(chunk, max(p.max_tokens for p in params), timer)
            out_tokens += sum(p.max_tokens for p in params)
            bar.update(len(chunk))
        elapsed = time.perf_counter() - start
        bar.close()
        run = {
            "elapsed_time": elapsed,
            "num_requests": len(ids),
            "prompt_tokens": sum(map(len, ids)),
            "output_tokens": out_tokens,
            "load_time_s": load_time_s,
            "bytes_per_token": bytes_per_token,
        }
        if timer is not None and timer.first_token_time is not None:
            ttft = timer.first_token_time - start
            run["median_ttft_s"] = ttft
            run["decode_tokens_per_second"] = (out_tokens - 1) / (elapsed - ttft)
        runs.append(run)
    return runs
