"""How many draft tokens each request verifies this step: as many as pay for their rows.

On a CPU a decode step costs about fixed + per_row * rows: one row reads every weight (memory-bound), and
from a few rows on each extra row costs its share of the matmuls (2 AVX2 cores: ~7 ms + ~3.7 ms a row on
the default model). A draft token is a row that yields a token only if it and the drafts before it are
accepted: the j-th draft of a request whose drafts hold with probability a yields a^j tokens. Rows are
added best first while their yield per second beats the step's: single-stream copying takes all k, a
batch of 32 already compute-bound takes only near-certain guesses, so speculation never makes a step
yield fewer tokens a second than it would without (the W32 case).

The step cost is measured once at start-up (StepCost.measure); each request's acceptance is estimated
from its own verifications over the engine-wide rate (AcceptanceTracker).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class StepCost:
    """Seconds a step of `rows` decode rows takes: fixed + per_row * rows."""

    fixed: float
    per_row: float

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    @classmethod
    def measure(
        cls, runner, kv: KVCacheManager, rows: tuple[int, int] = (1, 16), repeats: int = 3
    ) -> StepCost:
        """Time decode steps of rows[0] and rows[1] one-token contexts through the runner (before any
        request: it borrows rows[1] blocks and gives them back) and fit the line through them."""
        times = []
        for m in rows:
            m = min(m, kv.num_free_blocks)
            reqs = [
                Request(f"__cost_{i}__", [0, 0], SamplingParams(temperature=0, max_tokens=1))
                for i in range(m)
            ]
            for r in reqs:
                kv.allocate_slots(r, 2)
                r.num_computed_tokens = 1
            step = SchedulerOutput(reqs, {r.request_id: 1 for r in reqs}, [], [], m)
            runner.execute_model(step)  # first calls set up primitives
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                runner.execute_model(step)
                samples.append(time.perf_counter() - start)
            times.append((m, statistics.median(samples)))
            for r in reqs:
                kv.free(r)
        (m0, t0), (m1, t1) = times
        per_row = max((t1 - t0) / (m1 - m0), 1e-6) if m1 > m0 else t0 / 2
        cost = cls(max(t0 - per_row * m0, 0.0), per_row)
        logger.info(
            "speculative decoding: a decode step costs %.1f ms + %.2f ms a row",
            cost.fixed * 1e3,
            per_row * 1e3,
        )
        return cost


class AcceptanceTracker:
    """Each request's chance that a draft holds given the ones before it held: its own verifications
    (accepted drafts are successes, the first rejected one a failure; older ones decayed) over a prior
    worth PRIOR_WEIGHT verifications at the rate of every request's recent verifications (the engine-wide
    rate starts at INITIAL_RATE). A new request so starts where the workload stands: copying work
    speculates from its first step, a batch whose guesses fail stops guessing."""

    DECAY = 0.9  # a request's own counts, per verified draft
    GLOBAL_DECAY = 0.99
    PRIOR_WEIGHT = 2.0
    INITIAL_RATE = 0.7  # prompt lookup's guesses on copying text hold ~0.8-0.95 of the time

    def __init__(self):
        self._counts: dict[str, tuple[float, float]] = {}
        self._global = (self.INITIAL_RATE * self.PRIOR_WEIGHT, (1 - self.INITIAL_RATE) * self.PRIOR_WEIGHT)

    @property
    def global_rate(self) -> float:
        held, failed = self._global
        return held / (held + failed)

    def rate(self, request_id: str) -> float:
        held, failed = self._counts.get(request_id, (0.0, 0.0))
        return (held + self.PRIOR_WEIGHT * self.global_rate) / (held + failed + self.PRIOR_WEIGHT)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        rejected = float(num_accepted < num_drafts)
        held, failed = self._counts.get(request_id, (0.0, 0.0))
        decay = self.DECAY**num_drafts
        self._counts[request_id] = (held * decay + num_accepted, failed * decay + rejected)
        held, failed = self._global
        decay = self.GLOBAL_DECAY**num_drafts
        self._global = (held * decay + num_accepted, failed * decay + rejected)

    def retain(self, request_ids) -> None:
        for rid in [r for r in self._counts if r not in request_ids]:
            del self._counts[rid]


def allot_drafts(
    rates: dict[str, float], max_drafts: dict[str, int], base_rows: int, cost: StepCost
) -> dict[str, int]:
    """Draft tokens per request: candidate rows (request r's j-th draft yields rates[r] ** j tokens) taken best
    first while yield / per_row beats the step's tokens / cost(rows) so far (base_rows one-token decodes)."""
    candidates = sorted(
        ((rates[rid] ** j, rid) for rid, k in max_drafts.items() for j in range(1, k + 1)),
        key=lambda c: -c[0],
    )
    allotted = dict.fromkeys(max_drafts, 0)
    tokens, rows = float(base_rows), base_rows
    for gain, rid in candidates:
        if gain * cost(rows) <= tokens * cost.per_row:
            break
        allotted[rid] += 1
        tokens += gain
        rows += 1
    return allotted
