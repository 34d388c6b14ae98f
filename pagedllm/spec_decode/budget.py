"""How many draft tokens each request verifies this step: as many as pay for their rows.

On a CPU one row of a decode step reads every weight (memory-bound), and from a few rows on each extra
row costs its share of the matmuls (2 AVX2 cores, the default model: 11 ms for 1 row, 19 ms for 4, 64 ms
for 16). A draft token is a row that yields a token only if it and the drafts before it are
accepted: the j-th draft of a request whose drafts hold with probability a yields a^j tokens. Rows are
added best first while their yield per second beats the step's: single-stream copying takes all k, a
batch of 32 already compute-bound takes only near-certain guesses, so speculation never makes a step
yield fewer tokens a second than it would without (the W32 case).

The step cost is measured once at start-up at 1, 2, 4, 8 and 16 rows (StepCost.measure, through the
executor); each request's acceptance is estimated from its own verifications over the engine-wide rate
(AcceptanceTracker).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import RunnerSync
from pagedllm.executor import Executor
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class StepCost:
    """Seconds a step of `rows` decode rows takes, measured at a few row counts and interpolated between
    them (extrapolated past the last along its last segment). Not one line: an fp32 torch matmul of 2-4
    rows costs far more a row than one of 16 (oneDNN's small-M path), a quantized kernel's much less."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        if len(r) == 1:
            return s[0] * rows / r[0]
        i = next((i for i in range(1, len(r) - 1) if rows <= r[i]), len(r) - 1)
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return max(s[i - 1] + slope * (rows - r[i - 1]), 0.0)

    @classmethod
    def linear(cls, fixed: float, per_row: float) -> StepCost:
        return cls((1, 2), (fixed + per_row, fixed + 2 * per_row))

    @classmethod
    def measure(
        cls,
        executor: Executor,
        kv: KVCacheManager,
        rows: tuple[int, ...] = (1, 2, 4, 8, 16),
        repeats: int = 3,
    ) -> StepCost:
        """Time decode steps of each row count of one-token contexts through the executor, as the engine's
        steps run (in this process, or on every tensor-parallel rank with the pickling and collectives
        included), before any request: it borrows blocks and gives them back; the median of `repeats`
        after a first call."""
        counts, times = [], []
        sync = RunnerSync()
        for m in rows:
            m = min(m, kv.num_free_blocks)
            if counts and m <= counts[-1]:
                break
            reqs = [
                Request(f"__cost_{i}__", [0, 0], SamplingParams(temperature=0, max_tokens=1))
                for i in range(m)
            ]
            for r in reqs:
                kv.allocate_slots(r, 2)
                r.num_computed_tokens = 1
            # sent whole every time (the runner replaces its record), so the same step can run again
            step = sync.build(reqs, {r.request_id: 1 for r in reqs})
            executor.execute_model(step)  # first calls set up primitives
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                executor.execute_model(step)
                samples.append(time.perf_counter() - start)
            for r in reqs:
                kv.free(r)
                sync.finish(r.request_id)
            executor.execute_model(sync.build([], {}))  # the runner drops its records of them
            counts.append(m)
            # a step of more rows never costs less (noise can say otherwise)
            times.append(max(statistics.median(samples), times[-1] if times else 0.0))
        cost = cls(tuple(counts), tuple(times))
        logger.info(
            "speculative decoding: a decode step of %s rows costs %s ms",
            "/".join(map(str, counts)),
            "/".join(f"{t * 1e3:.1f}" for t in times),
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
    first while one more row raises the step's tokens per second: gain * cost(rows) > tokens *
    (cost(rows + 1) - cost(rows)), from base_rows one-token decodes."""
    candidates = sorted(
        ((rates[rid] ** j, rid) for rid, k in max_drafts.items() for j in range(1, k + 1)),
        key=lambda c: -c[0],
    )
    allotted = dict.fromkeys(max_drafts, 0)
    tokens, rows = float(base_rows), base_rows
    for gain, rid in candidates:
        if gain * cost(rows) <= tokens * (cost(rows + 1) - cost(rows)):
            break
        allotted[rid] += 1
        tokens += gain
        rows += 1
    return allotted
