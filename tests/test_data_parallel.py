"""Data-parallel replicas on Ray (`pagedllm serve --data-parallel-size N`, engine/data_parallel.py).

The router is tested alone, without Ray. The rest runs the real thing: a two-node Ray cluster on this one
machine (two raylets, one CPU and one custom resource each), the real server joined to it with
`--data-parallel-size 2 --ray-address`, one replica per node, and the official `openai` client.

Loopback only: Ray replaces 127.0.0.1 by the machine's outward address unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with that set `ray start --address` refuses to add a second
node. So the cluster is made by `ray.cluster_utils.Cluster` (Ray's own multi-node-on-one-machine test
cluster) in a helper process; at teardown that process and every process under it are ended by their
pids (not `ray stop --force`, which would end every Ray process on the machine, other users' too).

No test measures time: every wait is a bounded poll.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server import REQUEST_TIMEOUT_S, ServerInfo, read_metrics, running_server, wait_until

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.engine.async_engine import EngineClosedError
from pagedllm.engine.prefix_router import PrefixRouter

# ---------------------------------------------------------------------------------------------- router


def test_router_least_loaded_and_rotation():
    router = PrefixRouter(3, block_size=4)
    firsts = []
    for i in range(3):  # equally loaded: each gets one in turn
        r = router.choose([100 + i])
        router.assign([100 + i], r)
        firsts.append(r)
    assert sorted(firsts) == [0, 1, 2]
    router.release(1)
    assert router.choose([7]) == 1  # the only one with nothing in flight
    router.in_flight = [5, 2, 9]
    assert router.choose([1, 2, 3]) == 1


def test_router_block_hashes_are_the_prefix_cache_chain():
    router = PrefixRouter(2, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one, which has no hash
    h0 = hash_block_tokens(None, tokens[0:4])
    assert router.block_hashes(tokens) == [h0, hash_block_tokens(h0, tokens[4:8])]


def test_router_prefix_affinity():
    router = PrefixRouter(2, block_size=4)
    prefix = list(range(40))  # 10 blocks
    router.in_flight = [0, 3]
    router.assign(prefix + [1000], 1)  # replica 1 has it although it is the busier one
    assert router.choose(prefix + [2000, 2001]) == 1
    assert router.num_prefix_hits == 1
    # a prompt sharing only its first block with it (under half its blocks): least loaded instead
    other = prefix[:4] + list(range(500, 536))
    assert router.choose(other) == 0
    # no shared full block at all
    assert router.choose([9, 9, 9, 9, 9, 9, 9, 9]) == 0


def test_router_affinity_yields_to_imbalance():
    router = PrefixRouter(2, block_size=4, max_imbalance=4)
    prefix = list(range(32))
    router.assign(prefix, 1)
    router.in_flight = [0, 4]
    assert router.choose(prefix) == 1  # 4 more: still within the bound
    router.in_flight = [0, 5]
    assert router.choose(prefix) == 0


def test_router_skips_dead_replicas():
    router = PrefixRouter(3, block_size=4)
    prefix = list(range(32))
    router.assign(prefix, 2)
    router.mark_dead(2)
    assert router.choose(prefix) in (0, 1)  # its cached prefix died with it
    assert router.choose(prefix, exclude=[0]) == 1
    router.mark_dead(0)
    router.mark_dead(1)
    with pytest.raises(EngineClosedError):
        router.choose(prefix)


def test_router_lru_capacity():
    router = PrefixRouter(2, block_size=1, capacity=8)
    router.assign(list(range(20)), 1)
    assert len(router._owner) == 8
    # the oldest hashes (the shortest prefixes) went first; the 20-token prompt still finds its tail
    assert router.choose(list(range(20))) == 1


# ---------------------------------------------------------------------------------------------- options


def test_no_ray_import_without_data_parallel():
    code = (
        "import sys, pagedllm.engine.data_parallel, pagedllm.entrypoints.openai.server, "
        "pagedllm.entrypoints.cli.main; assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_data_parallel_size_is_one_line_and_exit_2():
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--data-parallel-size", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data-parallel-size" in lines[0], proc.stderr


def test_metrics_label_each_replica():
    from pagedllm.engine.llm_engine import EngineStats
    from pagedllm.metrics import ServerMetrics

    stats = EngineStats(
        num_running=2,
        num_waiting=1,
        num_blocks_total=64,
        num_free_blocks=60,
        num_cached_free_blocks=0,
        kv_cache_usage=0.0625,
        prefix_cache_queries=30,
        prefix_cache_hits=16,
        num_preemptions=0,
    )
    metrics = ServerMetrics(lambda: {"0": stats, "1": None}, replicas=["0", "1"])
    text = metrics.render().decode()
    assert 'pagedllm:replica_up{replica="0"} 1.0' in text
    assert 'pagedllm:replica_up{replica="1"} 0.0' in text
    assert 'pagedllm:num_requests_running{replica="0"} 2.0' in text
    assert 'pagedllm:prefix_cache_hits_total{replica="0"} 16.0' in text
    assert 'pagedllm:generation_tokens_total{replica="1"} 0.0' in text


# ---------------------------------------------------------------------------------------------- on Ray

CLUSTER_START_TIMEOUT_S = 180
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray keeps 127.0.0.1 as it is

# Two nodes, one CPU and one custom resource each; prints the head's address, then waits for stdin to close.
# Cluster writes the head's address to $RAY_TMPDIR/ray/ray_current_cluster (/tmp/ray/... by default) without
# creating the folder: on a fresh machine there is none. RAY_TMPDIR points it into the test's own folder, so the
# test also leaves alone the file a user's `ray.init()` reads.
CLUSTER_SCRIPT = """
import os
import sys
from ray.cluster_utils import Cluster

temp_dir = sys.argv[1]
os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)
store = 100 * 1024 * 1024
cluster = Cluster(initialize_head=True, head_node_args=dict(
    num_cpus=1, resources={"node_a": 1}, object_store_memory=store, include_dashboard=False, temp_dir=temp_dir))
cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=store, temp_dir=temp_dir)
print("ADDRESS", cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def _descendants(root: int) -> list[int]:
    """root and every process under it (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


@contextlib.contextmanager
def ray_cluster(temp_dir: str) -> Iterator[str]:
    env = {**os.environ, **LOOPBACK_ENV, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": temp_dir}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLUSTER_SCRIPT, temp_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    log: list[str] = []
    try:
        deadline = time.monotonic() + CLUSTER_START_TIMEOUT_S
        address = None
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.append(line)
            if line.startswith("ADDRESS "):
                address = line.split()[1]
        assert address is not None, "the Ray cluster did not start:\n" + "".join(log[-40:])
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        pids = _descendants(proc.pid)
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the helper shuts its cluster down
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        for pid in pids:  # whatever is left of what it started, by pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """The real server with two replicas of the default model, one on each node of a local Ray cluster."""
    temp_dir = f"/tmp/pgdp-{os.getpid()}"  # short: Ray's socket paths must fit in 107 bytes
    log = tmp_path_factory.mktemp("dp_server") / "server.log"
    with ray_cluster(temp_dir) as address, pytest.MonkeyPatch.context() as mp:
        for key, value in LOOPBACK_ENV.items():
            mp.setenv(key, value)
        args = ["--data-parallel-size", "2", "--ray-address", address, "--num-kv-blocks", "256"]
        args += ["--max-num-seqs", "32", "--max-model-len", "1024"]
        with running_server(log, *args) as info:
            yield info


@pytest.fixture
def dp_client(dp_server: ServerInfo) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(
        base_url=dp_server.url("/v1"), api_key=dp_server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    yield c
    c.close()


def _replicas(server: ServerInfo) -> list[dict]:
    body = httpx.get(server.url("/health"), timeout=10).json()
    assert body["status"] == "ok"
    return body["replicas"]


def _per_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        m = re.fullmatch(rf'pagedllm:{name}\{{replica="(\d+)"\}}', key)
        if m:
            out[m.group(1)] = value
    return out


@pytest.mark.slow
def test_one_replica_per_node(dp_server: ServerInfo):
    replicas = _replicas(dp_server)
    assert [r["replica"] for r in replicas] == ["0", "1"]
    assert all(r["alive"] for r in replicas)
    assert replicas[0]["node_id"] != replicas[1]["node_id"]
    assert replicas[0]["pid"] != replicas[1]["pid"]


@pytest.mark.slow
def test_concurrent_requests_use_both_replicas(dp_server: ServerInfo, dp_client: openai.OpenAI):
    before = _per_replica(read_metrics(dp_server), "generation_tokens_total")

    def one(i: int) -> int:
        r = dp_client.completions.create(
            model="default", prompt=f"Request {i}: the weather", max_tokens=6, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        tokens = list(pool.map(one, range(32)))
    assert tokens == [6] * 32
    after = _per_replica(read_metrics(dp_server), "generation_tokens_total")
    done = {k: after[k] - before.get(k, 0.0) for k in after}
    assert set(done) == {"0", "1"}
    assert done["0"] > 0 and done["1"] > 0, done
    assert done["0"] + done["1"] == 32 * 6


@pytest.mark.slow
def test_shared_prefix_lands_on_one_replica(dp_server: ServerInfo, dp_client: openai.OpenAI):
    prefix = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer briefly and plainly." for i in range(30)
    )
    before = read_metrics(dp_server)
    for i in range(5):
        dp_client.completions.create(model="default", prompt=f"{prefix}\nQuestion {i}: why?", max_tokens=2)
    after = read_metrics(dp_server)
    prompt = {
        k: v - _per_replica(before, "prompt_tokens_total").get(k, 0.0)
        for k, v in _per_replica(after, "prompt_tokens_total").items()
    }
    hits = {
        k: v - _per_replica(before, "prefix_cache_hits_total").get(k, 0.0)
        for k, v in _per_replica(after, "prefix_cache_hits_total").items()
    }
    busy = [k for k, v in prompt.items() if v > 0]
    assert len(busy) == 1, prompt  # all five on one replica
    assert hits[busy[0]] >= 4 * 128, hits  # and the four after the first found the prefix in its cache


@pytest.mark.slow
def test_killed_replica_takes_only_its_requests(dp_server: ServerInfo, dp_client: openai.OpenAI):
    victim = _replicas(dp_server)[1]

    def one(i: int) -> str:
        try:
            r = dp_client.completions.create(
                model="default", prompt=f"Tale {i}: a dragon", max_tokens=48, extra_body={"ignore_eos": True}
            )
            return "ok" if r.usage.completion_tokens == 48 else "short"
        except openai.APIStatusError as e:
            return f"error {e.status_code}"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        wait_until(lambda: _replicas(dp_server)[1]["in_flight"] > 0, 60, "requests on the victim replica")
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    print("requests in flight when replica 1 was killed:", results)
    # each request either finished or, if its replica died after it had output, got an error (500)
    assert all(r in ("ok", "error 500") for r in results), results
    assert results.count("ok") >= 1, results  # at least the other replica's
    wait_until(lambda: not _replicas(dp_server)[1]["alive"], 60, "the dead replica to be noticed")

    # the service keeps answering, on the replica that is left
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        again = list(pool.map(one, range(100, 104)))
    assert again == ["ok"] * 4
    metrics = read_metrics(dp_server)
    assert metrics['pagedllm:replica_up{replica="1"}'] == 0.0
    assert metrics['pagedllm:replica_up{replica="0"}'] == 1.0
    assert httpx.get(dp_server.url("/health"), timeout=10).status_code == 200


@pytest.mark.slow
def test_last_replica_dying_fails_its_streams_in_band(dp_server: ServerInfo, dp_client: openai.OpenAI):
    """Streams that already sent tokens end with an in-band error (no retry: the client has seen output);
    with no replica left, /health says 503 and new requests are refused."""
    live = [r for r in _replicas(dp_server) if r["alive"]]
    assert len(live) == 1  # after test_killed_replica_takes_only_its_requests
    label = live[0]["replica"]
    key = f'pagedllm:generation_tokens_total{{replica="{label}"}}'
    before = read_metrics(dp_server)[key]

    def one(i: int) -> str:
        try:
            stream = dp_client.completions.create(
                model="default",
                prompt=f"Song {i}: la la",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                pass
            return "ok"
        except openai.APIError as e:
            return "error: " + str(e)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(4)]
        wait_until(lambda: read_metrics(dp_server)[key] >= before + 4 * 4, 60, "tokens streamed")
        os.kill(live[0]["pid"], signal.SIGKILL)
        results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    assert all(r.startswith("error") and "died" in r for r in results), results
    wait_until(lambda: httpx.get(dp_server.url("/health"), timeout=10).status_code == 503, 60, "/health 503")
    with pytest.raises(openai.APIStatusError) as e:
        dp_client.completions.create(model="default", prompt="anyone?", max_tokens=2)
    assert e.value.status_code == 503
