"""CPU compute threads for `iterserve serve` (engine/model/threads.py): every CPU on big steps and
one core left to the HTTP loop on small ones by default, OMP_NUM_THREADS and --threads obeyed. Each case runs in a fresh interpreter, because torch's
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
    "from iterserve.engine.model.threads import apply_step_threads, configure_serving_threads, prefer_passive_wait\n"
    "from iterserve.engine.model.threads import usable_cpus\n"
    "early = prefer_passive_wait()\n"
    "import torch\n"
    "got = configure_serving_threads(os.environ.get('PROBE_THREADS', 'auto'))\n"
    "at_start = torch.get_num_threads()\n"
    "from iterserve.engine.model import cpu_w8a8\n"
    "apply_step_threads(2)\n"  # a decode step with two sequences
    "small = torch.get_num_threads()\n"
    "apply_step_threads(512)\n"  # a prefill chunk
    "print(json.dumps({'returned': [got.small, got.big], 'torch': at_start, 'small_step': small,\n"
    "                  'kernel': cpu_w8a8.kernel_threads(),\n"
    "                  'big_step': torch.get_num_threads(), 'cpus': usable_cpus(), 'early': early,\n"
    "                  'wait': os.environ.get('OMP_WAIT_POLICY')}))\n"
)


def probe(env_threads: str | None, affinity: set[int] | None = None, wait: str | None = None,
          flag: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    if flag is not None:
        env["PROBE_THREADS"] = flag
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


def test_step_threads_policy_table():
    choose = threads.choose_step_threads
    assert choose("auto", 2, None) == (threads.StepThreads(1, 2, split=True), "--threads auto")
    assert choose("auto", 1, None)[0] == threads.StepThreads(1, 1)
    assert choose("auto", 16, None)[0] == threads.StepThreads(15, 16, split=True)
    assert choose("auto", 2, 1) == (threads.StepThreads(1, 1), "OMP_NUM_THREADS=1")  # the user's variable wins
    assert choose("3", 2, 1) == (threads.StepThreads(3, 3), "--threads 3")  # over which the flag wins
    assert not choose("2", 2, None)[0].split and not choose("auto", 2, 2)[0].split  # a fixed count: one call
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="--threads must be auto or a positive integer"):
            choose(bad, 2, None)
    policy = threads.StepThreads(1, 2)
    big = threads.BIG_STEP_TOKENS
    assert [policy.for_tokens(n) for n in (1, big - 1, big, 512)] == [1, 1, 2, 2]


def test_server_default_uses_every_cpu_on_big_steps_and_one_fewer_on_small_ones():
    result, log = probe(None)
    cpus = result["cpus"]
    assert cpus == threads.usable_cpus()
    assert result["returned"] == [max(1, cpus - 1), cpus]
    assert result["torch"] == result["big_step"] == cpus and result["small_step"] == max(1, cpus - 1)
    assert result["kernel"] == cpus  # the w8a8 kernel's own pool: every CPU on every step outside a split
    assert "--threads auto" in log and "on steps of >= 32 tokens" in log or cpus == 1
    assert result["early"] and result["wait"] == "PASSIVE"


def test_threads_flag_fixes_the_count_for_every_step():
    result, log = probe("1", flag="1")  # the flag wins over OMP_NUM_THREADS
    assert result["returned"] == [1, 1] and result["small_step"] == result["big_step"] == 1 == result["kernel"]
    assert "--threads 1" in log and "1 on every step" in log


def test_a_wait_policy_already_set_is_kept():
    result, _ = probe(None, wait="ACTIVE")
    assert result["wait"] == "ACTIVE"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not __import__("shutil").which("taskset"),
                    reason="needs two CPUs and taskset")
def test_affinity_mask_counts():
    result, _ = probe(None, affinity=set(sorted(os.sched_getaffinity(0))[:1]))
    assert result["cpus"] == 1
    assert result["small_step"] == result["big_step"] == 1


@pytest.mark.skipif(threads.usable_cpus() < 2, reason="on one CPU the default and the override agree")
def test_omp_num_threads_is_obeyed():
    cpus = threads.usable_cpus()  # torch caps OMP_NUM_THREADS at the CPUs; all of them differs from the default
    result, log = probe(str(cpus))
    assert result["returned"] == [cpus, cpus] and result["small_step"] == result["big_step"] == cpus
    assert f"OMP_NUM_THREADS={cpus}" in log
