"""Where a decode step's time goes, and the C++ decode stack against the layer loop, in one process.

.venv/bin/python scripts/profile_step.py gguf 1      # single stream, the default model's GGUF blocks
.venv/bin/python scripts/profile_step.py none 32     # 32 W32 sequences, bf16
PAGEDLLM_PROFILE_MODEL=/tmp/models/llama1b-q4_k_m.gguf .venv/bin/python scripts/profile_step.py none 1   # a file

It runs N W32 prompts about 40 steps in, then (1) times 100 steps with the step's parts wrapped (the
scheduler, building the inputs, the model, the lm_head, sampling) and (2) alternates 5 x 8 steps with
and without the decode stack (model/decode_stack.py), printing each median.
"""

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pagedllm.worker.model_runner as model_runner
from pagedllm import LLM, SamplingParams

W32 = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "w32.jsonl"

quantization = None if sys.argv[1:2] in ([], ["none"]) else sys.argv[1]
num_seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model_path = os.environ.get("PAGEDLLM_PROFILE_MODEL")  # a GGUF file or HF folder instead of the default
kwargs = {"model": model_path, "kv_cache_memory": "1GiB"} if model_path else {}
engine = LLM(show_progress=False, quantization=quantization, **kwargs).llm_engine
prompts = [json.loads(line)["prompt"] for line in W32.read_text().splitlines()]
for i, prompt in enumerate(prompts[:num_seqs]):
    engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
for _ in range(40):
    engine.step()

spent: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


model = engine.model
timed(engine.scheduler, "schedule", "schedule")
timed(engine.runner, "prepare_inputs", "prepare inputs")
timed(model, "forward", "model (decoder layers)")
timed(model, "compute_logits", "lm_head")
timed(model_runner, "sample_requests", "sample")
steps = 100
start = time.perf_counter()
for _ in range(steps):
    engine.step()
total = (time.perf_counter() - start) / steps
print(f"{quantization or 'bf16'}, {num_seqs} sequences: {total * 1e3:.2f} ms a step")
for label, seconds in spent.items():
    print(f"  {label:24s} {seconds / steps * 1e3:6.2f} ms")

stack = model.decode_stack
if stack is None:
    sys.exit("no decode stack for this model here (no compiler, or a layout it does not take)")
medians: dict[str, list[float]] = {"stack": [], "layer loop": []}
for _ in range(5):
    for mode in medians:
        model.decode_stack = stack if mode == "stack" else None
        times = []
        for _ in range(8):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        medians[mode].append(statistics.median(times) * 1e3)
model.decode_stack = stack
for mode, values in medians.items():
    print(f"  {mode:12s} {statistics.median(values):6.2f} ms  ({' '.join(f'{v:.1f}' for v in values)})")
