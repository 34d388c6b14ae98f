"""--scheduling-policy priority (issue 38 item 3): requests rank by (priority, arrival), lower first.

The scheduler on tests/test_scheduler.py's fake runner (which reads every sequence back through its block
table, so a preemption that loses or corrupts KV changes the outputs); the offline API and the fcfs refusal
on a tiny real checkpoint; and the issue's Done-when line on the real server with the default model: with
--max-num-seqs 2 and 12 long low-priority requests in, a later priority-0 request finishes before the
median low-priority one. No test measures time: the server test asserts on the order requests finish in.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_scheduler import BS, FakeRunner, make_request, run_all, step, workload
from test_server import ServerInfo, read_metrics, running_server, wait_until

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams


def make_scheduler(policy="priority", num_blocks=256, max_num_seqs=64, budget=2048):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=True),
    )


def finish_order(sched, runner=None, max_steps=10_000) -> list[str]:
    runner = runner or FakeRunner()
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return order
        _, done = step(sched, runner)
        order += [r.request_id for r in done]
    raise AssertionError("the requests did not finish")


def outputs_alone(specs) -> dict[str, list[int]]:
    """What each (rid, prompt, max_tokens) produces with room for all: the reference for preempted runs."""
    sched = make_scheduler("fcfs", num_blocks=2000)
    for rid, prompt, max_tokens in specs:
        sched.add_request(make_request(rid, prompt, max_tokens))
    return {rid: r.output_token_ids for rid, r in run_all(sched).items()}


def group(rid, prompt, n, max_tokens, arrival, priority) -> list[Request]:
    """The n sibling requests of one (rid, prompt)."""
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    return [
        Request(
            f"{rid}-{i}", list(prompt), params, arrival_time=arrival, group_id=rid, index=i, priority=priority
        )
        for i in range(n)
    ]


# (rid, priority, arrival); f arrives with b and is added after it
QUEUE = [("a", 2, 0.0), ("b", 0, 1.0), ("f", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", -1, 4.0)]


@pytest.mark.parametrize(
    "policy,expected",
    [("priority", ["e", "b", "f", "d", "c", "a"]), ("fcfs", ["a", "b", "f", "c", "d", "e"])],
)
def test_waiting_queue_serves_by_priority_then_arrival(policy, expected):
    sched = make_scheduler(policy, max_num_seqs=1)  # one at a time: finish order = admission order
    for i, (rid, priority, t) in enumerate(QUEUE):
        sched.add_request(make_request(rid, range(10 * i, 10 * i + 5), 3, arrival=t, priority=priority))
    assert [r.request_id for r in sched.waiting] == expected  # the queue iterates in serving order
    assert finish_order(sched) == expected


def test_urgent_request_preempts_the_lowest_ranked_running_one():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    specs = [("a", list(range(20)), 20), ("b", list(range(50, 70)), 20), ("u", list(range(80, 90)), 20)]
    a, b, u = (make_request(rid, p, mt, arrival=float(i), priority=prio) for i, ((rid, p, mt), prio) in
               enumerate(zip(specs, [5, 3, 0])))  # fmt: skip
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched, runner)
    sched.add_request(u)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["a"]  # the worst priority goes, though it came first
    assert sorted(out.scheduled_req_ids) == ["b", "u"]
    assert a.status == RequestStatus.PREEMPTED and a.block_ids == [] and a.num_computed_tokens == 0
    assert list(sched.waiting) == [a]
    order = finish_order(sched, runner)
    assert order.index("u") < order.index("a")
    got = {r.request_id: r.output_token_ids for r in (a, b, u)}
    assert got == outputs_alone(specs)  # a recomputed what it had, and went on as if never preempted
    assert sched.num_preemptions == 1 == a.num_preemptions
    assert sched.kv_cache_manager.num_free_blocks == 256


@pytest.mark.parametrize("policy,newcomer", [("priority", 0), ("priority", 1), ("fcfs", -5)])
def test_no_preemption_for_a_request_that_does_not_outrank(policy, newcomer):
    """Equal priority ranks by arrival (the running ones came first); fcfs ignores priority altogether."""
    sched = make_scheduler(policy, max_num_seqs=2)
    runner = FakeRunner()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", range(10 * i, 10 * i + 8), 6, arrival=float(i)))
    step(sched, runner)
    sched.add_request(make_request("new", range(90, 98), 6, arrival=5.0, priority=newcomer))
    for _ in range(3):
        out, _ = step(sched, runner)
        assert not out.preempted_request_ids and "new" not in out.scheduled_req_ids
    assert finish_order(sched, runner) == ["r0", "r1", "new"]


def test_short_blocks_preempt_the_lowest_ranked_not_the_newest():
    # as test_scheduler's test_preempted_request_goes_to_front_of_waiting_and_newest_is_victim, but the
    # older request has the worse priority: it is the one preempted
    sched = make_scheduler(num_blocks=4, budget=64)
    runner = FakeRunner()
    old = make_request("old", range(30), max_tokens=30, arrival=1.0, priority=1)
    new = make_request("new", range(100, 130), max_tokens=30, arrival=2.0, priority=0)
    sched.add_request(old)
    sched.add_request(new)
    for _ in range(6):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["old"]
    assert out.scheduled_req_ids == ["new"]
    expected = outputs_alone([("old", list(range(30)), 30), ("new", list(range(100, 130)), 30)])
    assert finish_order(sched, runner) == ["new", "old"]
    assert {"old": old.output_token_ids, "new": new.output_token_ids} == expected


def test_urgent_request_preempts_for_blocks_when_a_slot_is_free():
    sched = make_scheduler(num_blocks=6, max_num_seqs=4)
    runner = FakeRunner()
    low = make_request("low", range(60), max_tokens=4, arrival=0.0, priority=9)  # 4 of the 6 blocks
    sched.add_request(low)
    step(sched, runner)
    urgent = make_request("urgent", range(100, 140), max_tokens=5, arrival=1.0)  # 3 blocks
    sched.add_request(urgent)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["low"] and out.scheduled_req_ids == ["urgent"]
    assert finish_order(sched, runner) == ["urgent", "low"]
    expected = outputs_alone([("low", list(range(60)), 4), ("urgent", list(range(100, 140)), 5)])
    assert {"low": low.output_token_ids, "urgent": urgent.output_token_ids} == expected
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_abort_a_waiting_request_under_priority():
    sched = make_scheduler(max_num_seqs=1)
    for i, priority in enumerate([3, 1, 2]):
        sched.add_request(
            make_request(f"r{i}", range(10 * i, 10 * i + 4), 2, arrival=float(i), priority=priority)
        )
    sched.finish_requests("r2")
    assert [r.request_id for r in sched.waiting] == ["r1", "r0"]
    with pytest.raises(ValueError):  # as deque.remove: only a waiting request can be removed
        sched.waiting.remove_request(make_request("x", [1], 1))
    assert finish_order(sched) == ["r1", "r0"]


@pytest.mark.parametrize("seed", range(4))
def test_priorities_arrivals_and_memory_pressure_keep_every_output(seed):
    """Random priorities, n > 1 groups, requests arriving while others run, few blocks and slots: every
    request produces what it produces alone, and every block comes back."""
    rng = random.Random(seed)
    specs = [
        (rid, prompt, mt, rng.randint(-2, 2), rng.choice([1, 1, 2])) for rid, prompt, mt, _ in workload(seed)
    ]
    reference = make_scheduler("fcfs", num_blocks=2000)
    for t, (rid, prompt, mt, priority, n) in enumerate(specs):
        for r in group(rid, prompt, n, mt, float(t), priority):
            reference.add_request(r)
    expected = {k: r.output_token_ids for k, r in run_all(reference).items()}

    sched = make_scheduler(num_blocks=14, max_num_seqs=rng.choice([2, 4]), budget=rng.choice([32, 64]))
    runner = FakeRunner()
    pending = list(enumerate(specs))
    finished = {}
    for _ in range(5000):
        if pending and rng.random() < 0.3:  # arrivals while others run
            t, (rid, prompt, mt, priority, n) = pending.pop(0)
            for r in group(rid, prompt, n, mt, float(t), priority):
                sched.add_request(r)
        elif not sched.has_unfinished_requests() and not pending:
            break
        _, done = step(sched, runner)
        finished.update((r.request_id, r) for r in done)
    assert {k: r.output_token_ids for k, r in finished.items()} == expected
    assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.num_free_blocks == 14


# ---------------------------------------------------------------- the engine and the offline API (tiny model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import save_tiny_llama

    return str(save_tiny_llama(tmp_path_factory.mktemp("priority") / "tiny"))


def tiny_engine(path: str, policy: str, **kw) -> LLMEngine:
    return LLMEngine(path, num_kv_blocks=64, show_progress=False, scheduling_policy=policy, **kw)


def test_bad_policy_is_refused_before_loading():
    with pytest.raises(InputError) as e:
        LLMEngine("/nonexistent/model", scheduling_policy="lifo")
    assert e.value.param == "scheduling_policy"


@pytest.mark.slow
def test_offline_generate_runs_by_priority(tiny: str):
    llm = LLM(tiny, num_kv_blocks=64, show_progress=False, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[1, 2, 3 + i] for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2, 0])
    assert [o.prompt_token_ids for o in outs] == prompts  # in input order, as always
    ran = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert ran == [3, 1, 2, 0]  # one at a time, by priority
    with pytest.raises(InputError) as e:
        llm.generate(prompts, params, use_tqdm=False, priority=[0])
    assert e.value.param == "priority"


@pytest.mark.slow
def test_fcfs_refuses_a_priority_by_name(tiny: str):
    engine = tiny_engine(tiny, "fcfs")
    engine.add_request("zero", [1, 2], SamplingParams(max_tokens=1), priority=0)  # 0 is fcfs's own
    for bad in (1, -1, 1.5):
        with pytest.raises(InputError) as e:
            engine.add_request(f"p{bad}", [1, 2], SamplingParams(max_tokens=1), priority=bad)
        assert e.value.param == "priority"
    assert engine.scheduler.num_waiting == 1


@pytest.fixture(scope="module")
def fcfs_server(tiny: str) -> Iterator[str]:
    """The real server app over a real engine (the tiny checkpoint, default fcfs policy), in this process."""
    from fake_engine import serve_in_thread

    with serve_in_thread(AsyncEngine(tiny_engine(tiny, "fcfs"))) as (base_url, _):
        yield base_url


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fcfs_server_refuses_priority_with_a_400_naming_it(fcfs_server: str, path: str):
    body = {"model": "fake", "max_tokens": 2, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    for priority, status in ((1, 400), (0, 200)):
        r = httpx.post(fcfs_server + path, json={**body, "priority": priority}, timeout=60)
        assert r.status_code == status, r.text
        if status == 400:
            error = r.json()["error"]
            assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


# ----------------------------------------------------------- the Done-when line: a real server, default model

NUM_LOW = 12
LOW_PRIORITY = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("priority_server") / "server.log"
    with running_server(
        log, "--scheduling-policy", "priority", "--max-num-seqs", "2", "--num-kv-blocks", "256"
    ) as info:
        yield info


@pytest.mark.slow
def test_saturated_server_finishes_a_later_urgent_request_before_the_median_low_one(server: ServerInfo):
    """12 long priority-10 requests on 2 slots, then a priority-0 one: it overtakes the queue and takes a
    running request's slot (a preemption in /metrics)."""
    preemptions_before = read_metrics(server)["pagedllm:num_preemptions_total"]
    finished: list[str] = []

    async def one(client: openai.AsyncOpenAI, name: str, priority: int) -> None:
        r = await client.completions.create(
            model=server.model,
            prompt=f"Story number {name}: once upon a time",
            max_tokens=48,
            temperature=0,
            extra_body={"priority": priority, "ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 48
        finished.append(name)

    def queued() -> bool:
        m = read_metrics(server)
        return m["pagedllm:num_requests_running"] == 2 and m["pagedllm:num_requests_waiting"] == NUM_LOW - 2

    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=server.url("/v1"), api_key=server.api_key, timeout=300, max_retries=0
        ) as client:
            lows = [asyncio.create_task(one(client, f"low{i}", LOW_PRIORITY)) for i in range(NUM_LOW)]
            await asyncio.to_thread(wait_until, queued, 120, "the low-priority requests to fill the server")
            await one(client, "urgent", 0)
            await asyncio.gather(*lows)

    asyncio.run(main())
    assert sorted(finished) == sorted([*(f"low{i}" for i in range(NUM_LOW)), "urgent"])
    lows_before = finished.index("urgent")  # every request before it in the order is a low one
    assert lows_before < NUM_LOW // 2, finished  # before the median low-priority one
    assert read_metrics(server)["pagedllm:num_preemptions_total"] > preemptions_before


@pytest.mark.slow
def test_priority_must_be_an_integer(server: ServerInfo):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2, "priority": "high"}
    r = httpx.post(server.url("/v1/completions"), json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
