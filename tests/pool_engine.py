"""PoolEngine: tests/fake_engine.py's interface over a real Scheduler with a big pool and no model.

Its requests are put in the scheduler at start and stepped with a made-up sampled token, so every block
table and ref_cnt is the scheduler's own while a step costs milliseconds (plus step_delay, so that they
run for a while): enough to try the /kv page on a pool of tens of thousands of blocks, which the real
model could not fill on a CI machine's memory.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

from fake_engine import FakeEngine

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.kv_view import KVCacheView
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

BLOCK_BYTES = 16 * 23040  # the default model's fp32 KV: 368,640 bytes a block


class PoolEngine(FakeEngine):
    def __init__(
        self, num_blocks: int, num_requests: int, prompt_len: int, max_tokens: int, max_model_len: int = 8192
    ):
        super().__init__(max_model_len=max_model_len, num_kv_blocks=num_blocks, block_size=16, step_delay=0.1)
        self.scheduler = Scheduler(
            SchedulerConfig(num_requests, num_requests * prompt_len, max_model_len),
            CacheConfig(16, num_blocks),
        )
        rng = random.Random(0)
        shared = [rng.randrange(2, 30000) for _ in range(prompt_len // 2)]  # half of each prompt in common
        for i in range(num_requests):
            prompt = shared + [rng.randrange(2, 30000) for _ in range(prompt_len - len(shared))]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.scheduler.add_request(Request(f"pool-{i}", prompt, params))
        self.kv_block_bytes = BLOCK_BYTES
        self.kv_view: KVCacheView | None = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list:
        time.sleep(self.step_delay)
        out = self.scheduler.schedule()
        if self.kv_view is not None:
            self.kv_view.on_schedule(out)
        self.scheduler.update_from_output(out, {rid: 7 for rid in out.num_scheduled_tokens})
        return []

    # the engine's own: they need only scheduler, max_model_len, kv_block_bytes and kv_view
    open_kv_view = LLMEngine.open_kv_view
    close_kv_view = LLMEngine.close_kv_view

    def get_stats(self) -> SimpleNamespace:
        kv = self.scheduler.kv_cache_manager
        return SimpleNamespace(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_total=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
        )
