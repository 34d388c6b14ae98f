"""PAGEDLLM_CPU_BIND: torch's threads pinned one to a core on request (pagedllm/cpu_bind.py)."""

import os
import subprocess
import sys

import pytest

from pagedllm import cpu_bind
from pagedllm.errors import InputError


def test_binding_follows_the_setting_and_the_users_own_variables():
    assert cpu_bind.binding({}) is None  # off by default
    assert cpu_bind.binding({"PAGEDLLM_CPU_BIND": "off"}) is None
    assert cpu_bind.binding({"PAGEDLLM_CPU_BIND": "cores"}) == {
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": "cores",
    }
    assert cpu_bind.binding({"PAGEDLLM_CPU_BIND": "cores", "OMP_PLACES": "{0}"}) is None  # the user's rule
    with pytest.raises(InputError, match="PAGEDLLM_CPU_BIND must be one of off, cores, got 'all'"):
        cpu_bind.binding({"PAGEDLLM_CPU_BIND": "all"})


PROBE = """
import os, threading
from pagedllm import cpu_bind
assert cpu_bind.apply()
import torch
assert "OMP_PROC_BIND" not in os.environ and "OMP_PLACES" not in os.environ  # children start unpinned
torch.ones(1 << 20).sum()  # a parallel region: the pool's threads start
masks = []
t = threading.Thread(target=lambda: masks.append(os.sched_getaffinity(0)))
t.start(); t.join()
print(len(os.sched_getaffinity(0)), len(masks[0]), len(os.sched_getaffinity(0) | masks[0]))
"""


def test_cores_pins_the_pool_but_not_what_the_main_thread_starts():
    cpus = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in cpu_bind.USER_BINDING} | {
        "PAGEDLLM_CPU_BIND": "cores"
    }
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the main thread and a thread it starts keep the whole mask (libgomp had pinned it to one core)
    assert out.stdout.split() == [str(cpus)] * 3


def test_a_bad_value_is_one_line_and_exit_2():
    env = dict(os.environ, PAGEDLLM_CPU_BIND="all")
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "generate", "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "pagedllm generate: error: PAGEDLLM_CPU_BIND must be one of off, cores, got 'all'"
    ]
