"""The /kv page's engine side without a model: KVCacheView over a real Scheduler, KVPublisher's rate bound.

Requests are stepped as the engine steps them (schedule, the view's hook, update_from_output) with a made-up
sampled token, so every block table, ref_cnt, copy-on-write and eviction is the scheduler's own.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine import kv_publisher
from pagedllm.engine.kv_publisher import KVPublisher, KVSubscription
from pagedllm.engine.kv_view import STATES, KVCacheView
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams

BS = 16
MAX_LEN = 2048
SYSTEM = list(range(1000, 1200))  # a 200-token system prompt: 12 full blocks, then 8 tokens


def make(num_blocks: int = 256) -> tuple[Scheduler, KVCacheView]:
    sched = Scheduler(SchedulerConfig(64, 2048, MAX_LEN), CacheConfig(BS, num_blocks))
    return sched, KVCacheView(sched, max_model_len=MAX_LEN, block_bytes=BS * 1000)


def request(rid: str, prompt: list[int], max_tokens: int = 64, n: int = 1, index: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
    group = rid.split("#")[0] if n > 1 else None
    return Request(rid, prompt, params, group_id=group, index=index)


def step(sched: Scheduler, view: KVCacheView) -> None:
    out = sched.schedule()
    view.on_schedule(out)
    sched.update_from_output(out, {rid: 7 for rid in out.num_scheduled_tokens})


def state_of(snapshot: dict, block_id: int) -> str:
    return STATES[int(snapshot["states"][block_id])]


def rows(snapshot: dict) -> dict[str, dict]:
    return {row["id"]: row for row in snapshot["requests"]}


def test_the_pool_records_only_while_watched():
    sched, view = make()
    pool = sched.kv_cache_manager.block_pool
    assert pool.events is view.log
    view.close()
    assert pool.events is None  # nobody watches: the block pool records nothing


def test_shared_system_prompt_is_one_set_of_blocks_with_ref_cnt_2():
    sched, view = make()
    a, b = request("a", SYSTEM + [1, 2, 3]), request("b", SYSTEM + [4, 5, 6, 7])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, view)
    step(sched, view)
    snap = view.snapshot()
    assert a.block_ids[:12] == b.block_ids[:12] and a.block_ids[12] != b.block_ids[12]
    for block_id in a.block_ids[:12]:
        assert state_of(snap, block_id) == "shared" and snap["ref_cnts"][str(block_id)] == 2
    assert state_of(snap, a.block_ids[12]) == "used"
    assert snap["totals"]["shared_blocks"] == 12
    for req in (a, b):
        row = rows(snap)[req.request_id]
        s = req.num_computed_tokens
        assert row["table"] == req.block_ids and row["num_computed_tokens"] == s
        assert row["tail_waste"] == -(-s // BS) * BS - s == len(req.block_ids) * BS - s  # the seed's formula
        assert row["naive_waste"] == MAX_LEN - s
    assert snap["totals"]["waste_bytes"] == snap["totals"]["waste_tokens"] * 1000


def test_a_forked_request_shows_its_copy_on_write():
    sched, view = make()
    prompt = list(range(50))  # the fork shares 49 tokens: 3 full blocks and 1 token of the 4th
    leader, child = request("g#0", prompt, n=2, index=0), request("g#1", prompt, n=2, index=1)
    sched.add_request(leader)
    sched.add_request(child)
    for _ in range(3):
        step(sched, view)
    snap = view.snapshot()
    assert leader.block_ids[:3] == child.block_ids[:3]
    assert [state_of(snap, i) for i in child.block_ids[:3]] == ["shared"] * 3
    assert state_of(snap, child.block_ids[3]) == "cow"
    cow = [e for e in snap["events"] if e["kind"] == "cow"]
    assert cow == [{"kind": "cow", "step": 2, "block_id": child.block_ids[3], "src": leader.block_ids[3],
                    "request_id": "g#1"}]  # fmt: skip
    assert snap["totals"]["num_copies"] == 1


def test_finished_requests_leave_their_blocks_free_or_cached():
    sched, view = make()
    a, b = request("a", SYSTEM + [1], max_tokens=4), request("b", SYSTEM + [2], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    while sched.has_unfinished_requests():
        step(sched, view)
    snap = view.snapshot()
    assert snap["requests"] == []
    assert set(snap["states"]) <= {"0", "1"}
    assert snap["totals"]["cached_blocks"] == 12  # the shared prompt; each one's 13th block is not full


def test_a_cached_block_keeps_its_tokens_for_the_hover_until_it_is_evicted():
    sched, view = make(num_blocks=16)
    a = request("a", SYSTEM[:40], max_tokens=2)
    sched.add_request(a)
    step(sched, view)
    view.snapshot()
    first = a.block_ids[0]
    step(sched, view)  # a finishes: its two full blocks stay cached
    info = view.block_info(first)
    assert info["state"] == "cached" and info["ref_cnt"] == 0 and info["holders"] == []
    assert info["token_ids"] == SYSTEM[:16] and len(info["hash"]) == 16
    # a new request takes every block: the cached ones are evicted, their tokens are no longer theirs
    b = request("b", list(range(5000, 5000 + 16 * 16 - 1)), max_tokens=2)
    sched.add_request(b)
    step(sched, view)
    snap = view.snapshot()
    evicted = {e["block_id"] for e in snap["events"] if e["kind"] == "evict"}
    assert first in evicted and state_of(snap, first) == "evicted"
    at = b.block_ids.index(first) * BS  # its tokens now are b's there, as far as b's KV is computed
    assert view.block_info(first)["token_ids"] == b.token_ids_slice(at, min(at + BS, b.num_computed_tokens))
    with pytest.raises(InputError, match="block_id must be in"):
        view.block_info(16)


def test_a_preemption_is_an_event():
    sched, view = make(num_blocks=8)
    sched.add_request(request("old", list(range(60)), max_tokens=60))
    sched.add_request(request("new", list(range(100, 160)), max_tokens=60))
    events = []
    for _ in range(40):
        step(sched, view)
        events += view.snapshot()["events"]
    assert any(e == {"kind": "preempt", "step": e["step"], "request_id": "new"} for e in events)
    assert view.snapshot()["totals"]["num_preemptions"] == sched.num_preemptions > 0


class _FakeView:
    def __init__(self) -> None:
        self.log = SimpleNamespace(step=0)
        self.taken = 0

    def snapshot(self) -> dict:
        self.taken += 1
        return {"events": [self.taken]}


class _FakeEngine:
    def __init__(self) -> None:
        self.view: _FakeView | None = None

    def open_kv_view(self) -> _FakeView:
        self.view = _FakeView()
        return self.view

    def close_kv_view(self) -> None:
        self.view = None


def test_the_publisher_draws_at_most_10_times_a_second_and_not_at_all_when_idle(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(kv_publisher.time, "monotonic", lambda: clock[0])
    engine = _FakeEngine()
    publisher = KVPublisher(engine)
    loop = asyncio.new_event_loop()
    try:
        sub = KVSubscription(loop)
        publisher.add(sub)
        view = engine.view
        assert view.taken == 1  # a new watcher gets a snapshot at once
        for _ in range(1000):  # 1000 steps in 5 s
            clock[0] += 0.005
            view.log.step += 1
            publisher.tick()
        assert 45 <= view.taken - 1 <= 50  # 10 Hz at most (and not much less)
        clock[0] += 0.1
        publisher.tick()  # the last steps' change goes out
        taken = view.taken
        for _ in range(100):  # idle for 10 s: nothing changes, nothing is taken
            clock[0] += 0.1
            publisher.tick()
        assert view.taken == taken
        publisher.remove(sub)
        assert engine.view is None  # the last watcher left: the engine's view is closed
    finally:
        loop.close()


def test_a_slow_reader_keeps_every_event_of_the_snapshots_it_skipped():
    async def run() -> list:
        sub = KVSubscription(asyncio.get_running_loop())
        sub.offer({"seq": 1, "events": ["a"]})
        sub.offer({"seq": 2, "events": ["b"]})
        got = await sub.next(timeout=1)
        sub.offer(None)
        return [got, await sub.next(timeout=1), sub.ended]

    got, after_end, ended = asyncio.run(run())
    assert got == {"seq": 2, "events": ["a", "b"]} and after_end is None and ended
