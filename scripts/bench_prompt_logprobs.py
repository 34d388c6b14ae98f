"""The cost of prompt logprobs: one 512-token prompt scored (prompt_logprobs=5) against the same prompt
without them, same engine, alternated, median of 7 (prefix cache reset before each, so both prefill the
whole prompt). Not a test.

    .venv/bin/python scripts/bench_prompt_logprobs.py [--quantization none --dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(model="default", quantization=args.quantization, dtype=args.dtype, show_progress=False)
    ids = torch.randint(3, 49152, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = SamplingParams(temperature=0, max_tokens=1)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.repeat + 1):  # the first round warms up and is dropped
        for name, params in (("without", plain), ("with", scored)):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
    a, b = (statistics.median(times[k][1:]) for k in ("without", "with"))
    print(f"{args.length}-token prompt: without prompt logprobs {a * 1000:.0f} ms, with {b * 1000:.0f} ms "
          f"({b / a:.2f}x; +{(b - a) * 1000:.0f} ms, {(b - a) / args.length * 1e6:.0f} us a prompt token)")  # fmt: skip


if __name__ == "__main__":
    main()
