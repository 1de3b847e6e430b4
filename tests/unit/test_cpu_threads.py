"""CPU compute threads for `iterserve serve` (engine/model/threads.py): one core left to the HTTP
loop by default, OMP_NUM_THREADS obeyed. Each case runs in a fresh interpreter, because torch's
thread pool is process-global and OMP_NUM_THREADS is read when torch starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from iterserve.engine.model import threads

PROBE = (  # the order `iterserve serve` uses: wait policy before torch loads, then the thread count
    "import json, logging, os\n"
    "logging.basicConfig(level='INFO')\n"
    "from iterserve.engine.model.threads import configure_serving_threads, prefer_passive_wait, usable_cpus\n"
    "early = prefer_passive_wait()\n"
    "import torch\n"
    "got = configure_serving_threads()\n"
    "print(json.dumps({'returned': got, 'torch': torch.get_num_threads(), 'cpus': usable_cpus(), 'early': early,\n"
    "                  'wait': os.environ.get('OMP_WAIT_POLICY')}))\n"
)


def probe(env_threads: str | None, affinity: set[int] | None = None, wait: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads
    if wait is not None:
        env["OMP_WAIT_POLICY"] = wait
    command = [sys.executable, "-c", PROBE]
    if affinity is not None:
        command = ["taskset", "-c", ",".join(map(str, sorted(affinity))), *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_default_leaves_one_core():
    assert threads.default_compute_threads(1) == 1
    assert threads.default_compute_threads(2) == 1
    assert threads.default_compute_threads(16) == 15


def test_server_default_is_one_fewer_than_the_usable_cpus():
    result, log = probe(None)
    assert result["cpus"] == threads.usable_cpus()
    assert result["returned"] == result["torch"] == max(1, result["cpus"] - 1)
    assert "one left to the HTTP loop" in log
    assert result["early"] and result["wait"] == "PASSIVE"


def test_a_wait_policy_already_set_is_kept():
    result, _ = probe(None, wait="ACTIVE")
    assert result["wait"] == "ACTIVE"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not __import__("shutil").which("taskset"),
                    reason="needs two CPUs and taskset")
def test_affinity_mask_counts():
    result, _ = probe(None, affinity=set(sorted(os.sched_getaffinity(0))[:2]))
    assert result["cpus"] <= 2
    assert result["torch"] == 1


@pytest.mark.skipif(threads.usable_cpus() < 2, reason="on one CPU the default and the override agree")
def test_omp_num_threads_is_obeyed():
    cpus = threads.usable_cpus()  # torch caps OMP_NUM_THREADS at the CPUs; all of them differs from the default
    result, log = probe(str(cpus))
    assert result["returned"] == result["torch"] == cpus
    assert f"OMP_NUM_THREADS={cpus}" in log
