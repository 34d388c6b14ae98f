"""Where a whole W32 run's time goes: the prefill steps, the decode steps, and the engine outside the model.

.venv/bin/python scripts/profile_w32_run.py gguf     # the default model from its GGUF blocks
.venv/bin/python scripts/profile_w32_run.py none     # bf16 (the GGUF dequantized)
PAGEDLLM_PROFILE_MODEL=/tmp/models/llama1b-q4_k_m.gguf .venv/bin/python scripts/profile_w32_run.py none   # a file

It runs W32 as `pagedllm bench throughput` does (all 32 prompts at once, greedy, ignore_eos, the prefix
cache emptied first) three times in one process, drops the first, and prints for each of the other two
the wall time, every step that computed prompt tokens (its token count, sequences, milliseconds), the
decode steps' count, sum and median, and what the engine spent outside the model runner.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

W32 = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "w32.jsonl"

quantization = None if sys.argv[1:2] in ([], ["none"]) else sys.argv[1]
model_path = os.environ.get("PAGEDLLM_PROFILE_MODEL")  # a GGUF file or HF folder instead of the default
kwargs = {"model": model_path, "kv_cache_memory": "1GiB"} if model_path else {}
llm = LLM(show_progress=False, quantization=quantization, **kwargs)
engine = llm.llm_engine
prompts = [json.loads(line) for line in W32.read_text().splitlines()]
steps: list[tuple[int, int, float]] = []  # (tokens, sequences, seconds) per runner call
execute = engine.runner.execute_model


def timed_execute(scheduler_output, *args):
    start = time.perf_counter()
    try:
        return execute(scheduler_output, *args)
    finally:
        steps.append(
            (
                scheduler_output.total_num_scheduled_tokens,
                len(scheduler_output.num_scheduled_tokens),
                time.perf_counter() - start,
            )
        )


engine.runner.execute_model = timed_execute
for run in range(3):
    llm.reset_prefix_cache()
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=p["max_tokens"], ignore_eos=True)
        engine.add_request(f"{run}-{i}", p["prompt"], params)
    steps.clear()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    total = time.perf_counter() - start
    if run == 0:
        continue  # warm-up
    decode = [s for n, b, s in steps if n == b]
    prefill = [(n, b, s) for n, b, s in steps if n != b]
    print(f"run {run}: {total:.3f} s, {len(steps)} steps")
    for n, b, s in prefill:
        print(f"  prefill step: {n} tokens of {b} sequences, {s * 1e3:.1f} ms")
    print(
        f"  decode steps: {len(decode)}, {sum(decode):.3f} s in all, median {statistics.median(decode) * 1e3:.2f} ms"
        f" (first 10 {statistics.median(decode[:10]) * 1e3:.2f}, last 10 {statistics.median(decode[-10:]) * 1e3:.2f})"
    )
    print(f"  outside the runner: {total - sum(s for *_, s in steps):.3f} s")
