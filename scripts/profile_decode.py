"""Profile one W32 decode step: 32 running requests of the default model, contexts ~60 tokens in.

.venv/bin/python scripts/profile_decode.py          # median step time + torch.profiler table
.venv/bin/python scripts/profile_decode.py gguf     # the same with a quantization (gguf, int4, int8, ...)
PAGEDLLM_NO_CPU_KERNEL=1 .venv/bin/python scripts/profile_decode.py   # the pure-torch attention
"""

import json
import statistics
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams

W32 = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "w32.jsonl"

prompts = [json.loads(line)["prompt"] for line in W32.read_text().splitlines()]
quantization = sys.argv[1] if len(sys.argv) > 1 else None
engine = LLM(show_progress=False, quantization=quantization).llm_engine
for i, p in enumerate(prompts):
    engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
for _ in range(65):  # prefill (two steps at the 2048-token budget), then decodes
    engine.step()
times = []
for _ in range(10):
    t = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t)
print(
    f"decode step: median {statistics.median(times) * 1e3:.1f} ms for {len(engine.scheduler.running)} sequences"
)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        engine.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
