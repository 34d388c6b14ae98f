"""Does a long waiting queue slow the offline engine's steps? (a benchmark, not a test)

    .venv/bin/python scripts/bench_offline_queue.py

One engine with a 48-block KV cache (the issue's setting: 200 prompts of 32 tokens do not fit at once),
the same running batch, and queues of different lengths behind it: the median step time should follow the
running batch, not the queue. Also runs the issue's workload end to end (LLM.generate of 200 prompts of 32
tokens, max_tokens 16) and reports its steps and time.
"""

from __future__ import annotations

import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def step_times(llm: LLM, num_waiting: int, steps: int = 30) -> tuple[float, int, int]:
    engine = llm.llm_engine
    rng = random.Random(num_waiting)
    ids = [f"q{num_waiting}-{i}" for i in range(16 + num_waiting)]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1000, 40000) for _ in range(32)], params)
    for _ in range(5):  # admit and prefill what fits
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    running, waiting = engine.scheduler.num_running, engine.scheduler.num_waiting
    engine.abort_request(ids)
    return statistics.median(times), running, waiting


def main() -> None:
    llm = LLM("default", num_kv_blocks=48, show_progress=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    print("queue length  running  median step")
    for num_waiting in (0, 150, 2000, 0):
        t, running, waiting = step_times(llm, num_waiting)
        print(f"{waiting:12d}  {running:7d}  {t * 1e3:8.1f} ms")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(200)]
    engine = llm.llm_engine
    steps = 0
    real_step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = counted
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    print(
        f"200 prompts x 32 tokens, max_tokens 16, 48 blocks: {len(outs)} finished in {wall:.1f} s, "
        f"{steps} steps, {wall / steps * 1e3:.0f} ms a step, {engine.get_stats().num_preemptions} preemptions"
    )


if __name__ == "__main__":
    main()
