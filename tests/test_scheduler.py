import random
import zlib

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

BS = 16


def make_scheduler(num_blocks=256, max_num_seqs=64, budget=2048, max_model_len=2048, prefix_caching=True):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
    )


def make_request(rid, prompt, max_tokens=8, arrival=0.0, **kw):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw.pop("sp", {}))
    return Request(rid, list(prompt), params, arrival_time=arrival, **kw)


def add_group(sched, gid, prompt, n, max_tokens=8, arrival=0.0):
    reqs = []
    for i in range(n):
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        r = Request(f"{gid}-{i}", list(prompt), params, arrival_time=arrival, group_id=gid, index=i)
        sched.add_request(r)
        reqs.append(r)
    return reqs


def fake_model(tokens: list[int]) -> int:
    return zlib.crc32(repr(tokens).encode()) % 1000


class FakeRunner:
    """Stands in for the model runner: keeps what the paged KV cache would hold (block -> offset ->
    (position, token)), applies copies, writes the batch, then "attends" by reading each sequence back
    through its block table. The sampled token depends only on what was read, so any paging bug
    (wrong block, missed copy, stale prefix hit) changes the outputs."""

    def __init__(self):
        self.slots: dict[int, dict[int, tuple[int, int]]] = {}
        self.all_copies: list[tuple[int, int]] = []
        self.batch = InputBatch()  # the real runner's record, kept from the plain-data steps only

    def execute(self, out) -> dict[str, int]:
        states = self.batch.update(out)
        for src, dst in out.blocks_to_copy:
            self.slots[dst] = dict(self.slots.get(src, {}))
        self.all_copies += out.blocks_to_copy
        for r in states:  # every layer writes the batch's KV before attention reads it
            tokens = r.tokens(0, r.num_tokens)
            start = r.num_computed_tokens
            for pos in range(start, start + out.num_scheduled_tokens[r.request_id]):
                self.slots.setdefault(r.block_ids[pos // BS], {})[pos % BS] = (pos, tokens[pos])
        sampled = {}
        for r in states:
            end = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
            seen = []
            for pos in range(end):
                got_pos, tok = self.slots[r.block_ids[pos // BS]][pos % BS]
                assert got_pos == pos, (r.request_id, pos)
                seen.append(tok)
            assert seen == r.tokens(0, end), r.request_id
            if end == r.num_tokens:
                sampled[r.request_id] = fake_model(seen)
        return sampled


def step(sched, runner):
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.scheduler_config.max_num_batched_tokens
    assert len(out.scheduled_req_ids) <= sched.scheduler_config.max_num_seqs
    assert len(sched.running) <= sched.scheduler_config.max_num_seqs
    return out, sched.update_from_output(out, runner.execute(out))


def run_all(sched, runner=None, max_steps=10_000):
    runner = runner or FakeRunner()
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, done = step(sched, runner)
        for r in done:
            finished[r.request_id] = r
    assert not sched.has_unfinished_requests()
    runner.batch.update(sched.schedule())  # an empty step carries the last finished ids
    assert not runner.batch.requests, "the runner still holds finished requests"
    return finished


def workload(seed=0, num=14):
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(40)]
    reqs = []
    for i in range(num):
        prompt = (shared[: rng.choice([0, 20, 40])]) + [
            rng.randrange(1000) for _ in range(rng.randint(1, 50))
        ]
        reqs.append((f"r{i}", prompt, rng.randint(5, 40), float(i)))
    return reqs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_does_not_change_outputs(prefix_caching):
    reference = make_scheduler(num_blocks=1000, prefix_caching=prefix_caching)
    for rid, prompt, mt, t in workload():
        reference.add_request(make_request(rid, prompt, mt, arrival=t))
    expected = run_all(reference)
    assert reference.num_preemptions == 0

    sched = make_scheduler(num_blocks=12, budget=64, prefix_caching=prefix_caching)
    for rid, prompt, mt, t in workload():
        sched.check_can_ever_fit(len(prompt), mt)
        sched.add_request(make_request(rid, prompt, mt, arrival=t))
    got = run_all(sched)
    assert sched.num_preemptions > 0
    assert {k: r.output_token_ids for k, r in got.items()} == {
        k: r.output_token_ids for k, r in expected.items()
    }
    assert all(r.finish_reason == "length" for r in got.values())
    assert sum(r.num_preemptions for r in got.values()) == sched.num_preemptions
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 12 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_preempted_request_goes_to_front_of_waiting_and_newest_is_victim():
    sched = make_scheduler(num_blocks=4, budget=64)
    runner = FakeRunner()
    old = make_request("old", range(30), max_tokens=30, arrival=1.0)
    new = make_request("new", range(100, 130), max_tokens=30, arrival=2.0)
    later = make_request("later", range(200, 201), max_tokens=5, arrival=3.0)
    sched.add_request(old)
    sched.add_request(new)
    step(sched, runner)  # each takes 2 blocks, all 4 in use
    sched.add_request(later)
    out, _ = step(sched, runner)  # both decode at position 30 within block 1: no new blocks
    for _ in range(5):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert list(sched.waiting)[:2] == [new, later]
    assert out.scheduled_req_ids == ["old"]  # no admission in a preempting step


def test_shared_system_prompt_uses_same_physical_blocks():
    rng = random.Random(1)
    system = [rng.randrange(1000) for _ in range(200)]
    sched = make_scheduler(num_blocks=600)
    runner = FakeRunner()
    reqs = [make_request(f"u{i}", system + [rng.randrange(1000) for _ in range(10)], 4) for i in range(32)]
    for r in reqs:
        sched.add_request(r)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        step(sched, runner)
    assert all(r.status == RequestStatus.RUNNING for r in reqs)
    prefix = reqs[0].block_ids[:12]  # 12 = 200 // 16 full blocks of the system prompt
    assert all(r.block_ids[:12] == prefix for r in reqs)
    assert all(sched.kv_cache_manager.block_pool.blocks[b].ref_cnt == 32 for b in prefix)
    in_use = 600 - sched.kv_cache_manager.num_free_blocks
    assert in_use == len({b for r in reqs for b in r.block_ids})
    assert in_use == 12 + sum(len(r.block_ids) - 12 for r in reqs)  # one copy of the prefix
    assert sched.kv_cache_manager.prefix_cache_stats.hits == 31 * 192

    run_all(sched, runner)
    # Finished: the prefix stays cached (free but findable) for the next request with that prompt.
    late = make_request("late", system + [1, 2, 3], 2)
    sched.add_request(late)
    step(sched, runner)
    assert late.block_ids[:12] == prefix


def test_parallel_sampling_forks_prompt_and_copies_partial_block():
    sched = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(500, 540))  # 40 tokens: 2 full blocks + 8 tokens; fork at 39
    sibs = add_group(sched, "g", prompt, 4, max_tokens=6)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"g-0": 39}  # the siblings wait for the leader
    assert sibs[0].num_computed_tokens == 39 and all(s.status == RequestStatus.WAITING for s in sibs[1:])
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"g-0": 1, "g-1": 1, "g-2": 1, "g-3": 1}
    tables = [s.block_ids for s in sibs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full prompt blocks shared, no copy
    assert len({t[2] for t in tables}) == 4  # the partial block was copied before each write
    assert len(out.blocks_to_copy) == 3 and all(src == sibs[0].block_ids[2] for src, _ in out.blocks_to_copy)
    done = run_all(sched, runner)
    assert set(done) == {"g-0", "g-1", "g-2", "g-3"}
    # Same prompt, same deterministic "model": every sibling saw the right KV, so the outputs agree.
    ref = make_scheduler()
    ref.add_request(make_request("solo", prompt, 6))
    solo = run_all(ref)["solo"].output_token_ids
    assert all(r.output_token_ids == solo for r in done.values())
    assert sched.kv_cache_manager.num_free_blocks == 256


@pytest.mark.parametrize("prompt_len", [1, 17, 33, 70])
def test_parallel_sampling_prompt_shapes(prompt_len):
    sched = make_scheduler(budget=32)  # 70 tokens: the leader's prefill is chunked too
    runner = FakeRunner()
    prompt = list(range(prompt_len))
    sibs = add_group(sched, "g", prompt, 3, max_tokens=20)
    leader_stops = []  # where the leader's prefill chunks end
    while not sibs[0].output_token_ids:
        step(sched, runner)
        leader_stops.append(sibs[0].num_computed_tokens)
    if prompt_len > 1:
        assert prompt_len - 1 in leader_stops  # it pauses before its last prompt token for the fork
        assert sibs[1].block_ids[: (prompt_len - 1) // BS] == sibs[0].block_ids[: (prompt_len - 1) // BS]
    done = run_all(sched, runner)
    ref = make_scheduler()
    ref.add_request(make_request("solo", prompt, 20))
    solo = run_all(ref)["solo"].output_token_ids
    assert [done[f"g-{i}"].output_token_ids for i in range(3)] == [solo] * 3
    if (prompt_len - 1) % BS == 0:
        assert runner.all_copies == []  # the fork point is a block boundary: nothing partial to share
    assert sched.kv_cache_manager.num_free_blocks == 256


def test_siblings_progress_when_leader_aborted_before_fork():
    sched = make_scheduler(budget=32)
    runner = FakeRunner()
    sibs = add_group(sched, "g", range(100), 3, max_tokens=5)
    step(sched, runner)
    assert sibs[0].num_computed_tokens == 32 and sibs[1].status == RequestStatus.WAITING
    sched.finish_requests("g-0", RequestStatus.FINISHED_ABORTED)
    assert sibs[0].finish_reason == "abort"
    done = run_all(sched, runner)
    assert set(done) == {"g-1", "g-2"} and all(r.num_output_tokens == 5 for r in done.values())
    assert sched.kv_cache_manager.num_free_blocks == 256


def test_siblings_progress_when_leader_preempted_before_fork():
    sched = make_scheduler(num_blocks=8, budget=32)
    runner = FakeRunner()
    blocker = make_request("blocker", range(900, 963), max_tokens=60, arrival=0.0)
    sched.add_request(blocker)
    while blocker.num_computed_tokens < 63:
        step(sched, runner)
    sibs = add_group(sched, "g", range(60), 2, max_tokens=30, arrival=1.0)
    step(sched, runner)
    assert sibs[0].num_computed_tokens == 31 and sibs[1].status == RequestStatus.WAITING
    out, _ = step(sched, runner)  # the blocker takes its 5th block; the leader's next chunk doesn't fit
    assert out.preempted_request_ids == ["g-0"]
    assert sibs[0].status == RequestStatus.PREEMPTED and sibs[1].status == RequestStatus.WAITING
    done = run_all(sched, runner)
    assert set(done) == {"blocker", "g-0", "g-1"}
    ref = make_scheduler()
    ref.add_request(make_request("solo", range(60), 30))
    solo = run_all(ref)["solo"].output_token_ids
    assert [s.output_token_ids for s in sibs] == [solo, solo]
    assert sched.kv_cache_manager.num_free_blocks == 8


def test_abort_running_returns_blocks_and_abort_waiting_works():
    sched = make_scheduler(num_blocks=20, max_num_seqs=1)
    runner = FakeRunner()
    a = make_request("a", range(40), max_tokens=50)
    b = make_request("b", range(40), max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert a.status == RequestStatus.RUNNING and len(a.block_ids) == 3
    assert b.status == RequestStatus.WAITING  # max_num_seqs = 1
    assert sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED) == [a]
    assert a.is_finished and a.finish_reason == "abort" and a.block_ids == []
    assert sched.kv_cache_manager.num_free_blocks == 20 and sched.get_request("a") is None
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.finish_reason == "abort" and not sched.has_unfinished_requests()
    assert sched.schedule().is_empty
    # A stop string found by the engine finishes with "stop".
    c = make_request("c", range(5), max_tokens=50)
    sched.add_request(c)
    step(sched, runner)
    sched.finish_requests("c", RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert c.finish_reason == "stop" and c.stop_reason == "###"
    assert sched.kv_cache_manager.num_free_blocks == 20


def test_chunked_prefill_mixes_with_decodes_and_respects_budget():
    sched = make_scheduler(budget=64)
    runner = FakeRunner()
    decoders = [make_request(f"d{i}", [i, i + 1, i + 2], max_tokens=100) for i in range(3)]
    for d in decoders:
        sched.add_request(d)
    step(sched, runner)
    long = make_request("long", range(300), max_tokens=4)
    sched.add_request(long)
    steps = 0
    while long.num_computed_tokens < 300:
        out, _ = step(sched, runner)
        steps += 1
        assert out.total_num_scheduled_tokens <= 64
        assert all(out.num_scheduled_tokens[d.request_id] == 1 for d in decoders)
        assert out.num_scheduled_tokens["long"] == min(61, 300 - sum([61] * (steps - 1)))
    assert steps == 5 and long.num_output_tokens == 1


def test_stop_conditions():
    sched = make_scheduler(max_model_len=64)
    out_of = {}

    def drive(req, tokens):
        sched.add_request(req)
        for tok in tokens:
            out = sched.schedule()
            done = sched.update_from_output(out, {req.request_id: tok})
            if done:
                out_of[req.request_id] = req
                return len(req.output_token_ids)
        return None

    eos = [7]
    r = make_request("eos", [1, 2], max_tokens=10, ignore_eos=False, eos_token_ids=eos)
    assert drive(r, [5, 7, 5]) == 2 and r.finish_reason == "stop" and r.stop_reason is None
    r = make_request("ign", [1, 2], max_tokens=3, eos_token_ids=eos)
    assert drive(r, [7, 7, 7, 7]) == 3 and r.finish_reason == "length"
    r = make_request("min", [1, 2], max_tokens=10, ignore_eos=False, eos_token_ids=eos, sp={"min_tokens": 3})
    assert drive(r, [7, 7, 7, 7]) == 3 and r.finish_reason == "stop"
    r = make_request("sti", [1, 2], max_tokens=10, sp={"stop_token_ids": [9], "min_tokens": 2})
    assert drive(r, [9, 9, 1]) == 2 and r.finish_reason == "stop" and r.stop_reason == 9
    r = make_request("ctx", range(60), max_tokens=None)
    assert drive(r, [1] * 10) == 4 and r.finish_reason == "length" and r.num_tokens == 64
    assert r.first_token_time is not None
    assert sched.kv_cache_manager.num_free_blocks == 256


def test_admission_check():
    sched = make_scheduler(num_blocks=8, max_model_len=256)  # the pool holds 128 tokens
    sched.check_can_ever_fit(100, 28)
    with pytest.raises(InputError, match=r"prompt has 300 tokens .*context length is 256") as e:
        sched.check_can_ever_fit(300, 1)
    assert e.value.param == "prompt"
    with pytest.raises(InputError, match="context length 256"):
        sched.check_can_ever_fit(200, 100)
    with pytest.raises(InputError, match="9 KV blocks .* 8 blocks"):
        sched.check_can_ever_fit(100, 29)
    with pytest.raises(InputError, match="KV blocks"):
        sched.check_can_ever_fit(10, None)  # may run to max_model_len = 256 tokens = 16 blocks
    big = make_scheduler(num_blocks=16, max_model_len=256)
    big.check_can_ever_fit(10, None)


def test_request_properties():
    r = make_request("x", [1, 2, 3])
    assert r.group_id == "x" and r.index == 0 and r.status == RequestStatus.WAITING
    r.output_token_ids += [4, 5]
    assert r.all_token_ids == [1, 2, 3, 4, 5] and r.num_tokens == 5
    assert r.num_prompt_tokens == 3 and r.num_output_tokens == 2
    assert not r.is_finished and r.finish_reason is None
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    assert not RequestStatus.PREEMPTED.is_finished()


def test_stats_and_duplicate_ids():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(20)))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", range(3)))
    # what LLMEngine.get_stats() reads: the scheduler's counts and the KV cache manager's usage
    assert (sched.num_running, sched.num_waiting, sched.num_preemptions) == (0, 1, 0)
    step(sched, FakeRunner())
    assert (sched.num_running, sched.num_waiting) == (1, 0) and sched.kv_cache_manager.usage == 2 / 256
    assert sched.get_request("a") is not None


@pytest.mark.parametrize("seed", range(6))
def test_everything_composes_under_memory_pressure(seed):
    """Prefix sharing, n > 1 groups, chunked prefill, preemption and aborts together: every request
    that is not aborted produces exactly what it produces alone, and every block comes back."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1000) for _ in range(rng.choice([16, 37, 50]))] for _ in range(3)]
    specs = []
    for i in range(16):
        prompt = rng.choice(stems + [[]]) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        specs.append((f"q{i}", prompt, rng.choice([1, 1, 1, 2, 3]), rng.randint(1, 30)))

    def add_all(sched):
        for t, (rid, prompt, n, mt) in enumerate(specs):
            if n == 1:
                sched.add_request(make_request(rid, prompt, mt, arrival=float(t)))
            else:
                add_group(sched, rid, prompt, n, max_tokens=mt, arrival=float(t))

    reference = make_scheduler(num_blocks=2000)
    add_all(reference)
    expected = {k: r.output_token_ids for k, r in run_all(reference).items()}

    num_blocks = 10
    sched = make_scheduler(
        num_blocks=num_blocks, budget=rng.choice([16, 40, 128]), max_num_seqs=rng.choice([4, 8])
    )
    add_all(sched)
    runner = FakeRunner()
    finished, aborted = {}, set()
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        _, done = step(sched, runner)
        finished.update((r.request_id, r) for r in done)
        if rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            aborted.add(victim)
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        pool = sched.kv_cache_manager.block_pool
        held = sum(len(r.block_ids) for r in sched.requests.values())
        assert sum(b.ref_cnt for b in pool.blocks) == held
    assert not sched.has_unfinished_requests()
    assert set(finished) | aborted == set(expected)
    for rid, r in finished.items():
        assert r.output_token_ids == expected[rid], rid
    assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.num_free_blocks == num_blocks


def test_token_ids_slice_is_a_slice_of_all_token_ids():
    # the model runner reads each step's new tokens with it: prompt only, output only, and across the two
    r = Request("r", [10, 11, 12, 13], SamplingParams(), arrival_time=0.0)
    r.output_token_ids.extend([20, 21, 22])
    n = r.num_tokens
    for start in range(n + 1):
        for end in range(start, n + 1):
            assert r.token_ids_slice(start, end) == r.all_token_ids[start:end], (start, end)


def test_a_long_queue_costs_one_lookup_a_step_not_one_per_waiting_request():
    """A full cache with thousands waiting: each step looks up the head of the queue once (it does not fit,
    so admission stops there), never the whole queue; the offline engine's steps then cost what the running
    batch costs however long the queue."""
    sched = make_scheduler(num_blocks=48, max_num_seqs=64)
    rng = random.Random(0)
    for i in range(2000):
        sched.add_request(make_request(f"r{i}", [rng.randrange(1000) for _ in range(32)], max_tokens=64))
    kv = sched.kv_cache_manager
    lookups = 0
    real = kv.get_computed_blocks

    def counting(request):
        nonlocal lookups
        lookups += 1
        return real(request)

    kv.get_computed_blocks = counting
    runner = FakeRunner()
    for _ in range(50):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    admitted = sum(1 for r in sched.requests.values() if r.status != RequestStatus.WAITING) + (
        2000 - len(sched.requests)
    )
    # one failed lookup per step at most, plus one per request admitted (re-admissions after preemption too)
    assert lookups <= 50 + admitted + sched.num_preemptions
    assert len(sched.waiting) > 1900
