"""The autoscaler against live engines: two real `iterserve serve --fake-model` processes with a
small KV pool (80 blocks of 16 tokens), one driven into KV thrash by `iterserve loadgen`, and a
real Prometheus scraping both.

One scenario runs once for the module (ticks every 0.5 s): the metrics reader plus the decision
function propose a scale-up while the waiting queue is above target; the KV retune lowers
max_num_seqs on the thrashing engine through its admin API until its pool fits, after which the
preemption counter stops rising; the Prometheus source reads the same signals. The numbers are
printed in the test output.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling import memory as mem
from iterserve.operator.autoscaling.engine_admin import EngineAdmin, apply_seqs_changes
from iterserve.operator.autoscaling.metrics_source import (
    PodEndpoint,
    PrometheusSource,
    ScrapeSource,
)
from iterserve.operator.autoscaling.policy import KvRetuneSettings, Settings, decide
from tests.server_fixture import ServerProcess, free_port, iterserve_command

pytestmark = pytest.mark.slow

TOKEN = "autoscaler-test-token"
ENGINE_ARGS = ["--fake-model", "--num-kv-blocks", "80", "--block-size", "16", "--max-num-seqs", "32",
               "--max-model-len", "256"]
# 32-token prompts + 96 generated = 8 blocks a sequence: 32 running need 256 blocks (thrash), 8 fit.
LOAD_ARGS = ["--requests", "3000", "--concurrency", "48", "--prompt-len", "32", "--max-tokens", "96",
             "--output-dist", "fixed"]
SETTINGS = Settings(min_replicas=1, max_replicas=8, target_waiting_per_replica=8, warmup_seconds=0,
                    preemption_window_seconds=5, spec_max_num_seqs=32,
                    kv_retune=KvRetuneSettings(threshold=0.95, consecutive_samples=2, step_factor=0.5, floor=2))
TICK_SECONDS = 0.5
PROMETHEUS = "/usr/bin/prometheus"


def _report(capsys, line: str) -> None:
    with capsys.disabled():
        print(line)


class Prometheus:
    """A real Prometheus on a free loopback port, scraping the given targets every second."""

    def __init__(self, workdir: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        static = "\n".join(f"      - targets: ['{address}']\n        labels: {{pod: {pod}, namespace: test}}"
                           for pod, address in targets.items())
        config = workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          f"scrape_configs:\n  - job_name: engines\n    static_configs:\n{static}\n")
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, cwd=workdir)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Scenario:
    ticks: list[dict] = field(default_factory=list)
    retunes: list[tuple[float, int, int]] = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    prometheus_reads: list[dict] = field(default_factory=list)
    prometheus_error: str | None = None
    engine_a_config: int | None = None
    engine_a_gauge: float | None = None


def _tick_row(t: float, samples, decision) -> dict:
    by = {s.pod: s for s in samples}
    row = {"t": round(t, 2), "desired": decision.desired_replicas, "reason": decision.reason}
    for pod, s in by.items():
        row[pod] = None if not s.ok else {"waiting": s.waiting, "running": s.running, "kv": round(s.kv_usage, 3),
                                          "preemptions": s.preemptions_total, "max_num_seqs": s.max_num_seqs}
    return row


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    workdir = tmp_path_factory.mktemp("autoscaler-live")
    env = {"ITERSERVE_ADMIN_TOKEN": TOKEN}
    engines = {pod: ServerProcess(ENGINE_ARGS, env, workdir / f"{pod}.log") for pod in ("engine-a", "engine-b")}
    prometheus = None
    try:
        if shutil.which(PROMETHEUS):
            prometheus = Prometheus(workdir, {pod: f"127.0.0.1:{e.port}" for pod, e in engines.items()})
        for engine in engines.values():
            engine.wait_ready()
        if prometheus:
            prometheus.wait_ready()
        yield _run(workdir, engines, prometheus)
    finally:
        for engine in engines.values():
            engine.stop()
        if prometheus:
            prometheus.stop()


def _run(workdir: Path, engines: dict[str, ServerProcess], prometheus: Prometheus | None) -> Scenario:
    result = Scenario()
    endpoints = [PodEndpoint(pod, e.url) for pod, e in engines.items()]
    urls = {pod: e.url for pod, e in engines.items()}
    scrape = ScrapeSource(timeout=2.0)
    prom = PrometheusSource(prometheus.url, selector='namespace="test"') if prometheus else None
    admin = EngineAdmin(TOKEN)
    start = time.time()
    pods = [mem.PodInfo(pod, start - 120, start - 100) for pod in engines]
    memory = mem.fresh_memory(2, start)

    def tick():
        nonlocal memory
        samples = asyncio.run(scrape.read(endpoints))
        now = time.time()
        memory = mem.record_samples(memory, samples, [p.name for p in pods], SETTINGS, now)
        decision = decide(SETTINGS, mem.state_for(memory, 2, pods), memory.history, now)
        outcome = asyncio.run(apply_seqs_changes(admin, decision.seqs_changes, urls))
        assert not outcome.failed, outcome.failed
        memory = mem.record_decision(memory, decision, SETTINGS, now, False, outcome.applied)
        for change in outcome.applied:
            result.retunes.append((round(now - start, 2), change.from_max_num_seqs, change.to_max_num_seqs))
        row = _tick_row(now - start, samples, decision)
        row["changes"] = [f"{c.pod} {c.from_max_num_seqs}->{c.to_max_num_seqs}" for c in outcome.applied]
        if prom:
            read = asyncio.run(prom.read(endpoints))
            result.prometheus_reads.append({s.pod: s for s in read})
        result.ticks.append(row)
        return samples, decision

    if prom:  # Prometheus has scraped both engines before the load starts
        deadline = time.time() + 15
        while not all(s.ok for s in asyncio.run(prom.read(endpoints))) and time.time() < deadline:
            time.sleep(0.3)
    samples, decision = tick()
    result.before = {"waiting": {s.pod: s.waiting for s in samples}, "desired": decision.desired_replicas,
                     "reason": decision.reason}

    loadgen = subprocess.Popen([*iterserve_command(), "loadgen", "--url", engines["engine-a"].url, *LOAD_ARGS],
                               cwd=workdir, stdout=(workdir / "loadgen.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        thrash_start = None
        settled_at = None
        deadline = time.time() + 60
        while time.time() < deadline:
            time.sleep(TICK_SECONDS)
            samples, decision = tick()
            a = next(s for s in samples if s.pod == "engine-a")
            if thrash_start is None and a.ok and a.running > 0:
                thrash_start = (time.time(), a.preemptions_total)
            if result.retunes and "first_retune" not in result.summary:
                elapsed = time.time() - thrash_start[0]
                result.summary["first_retune"] = (time.time(), a.preemptions_total)
                result.summary["preemptions_per_minute_before"] = round(
                    (a.preemptions_total - thrash_start[1]) * 60 / elapsed, 1)
            ticks_since_change = len(result.ticks) - 1 - max(
                (i for i, r in enumerate(result.ticks) if r["changes"]), default=len(result.ticks))
            recent = [r["engine-a"] for r in result.ticks[-2:]]
            no_pressure = all(r and r["kv"] <= SETTINGS.kv_retune.threshold and r["running"] <= r["max_num_seqs"]
                              for r in recent)
            if settled_at is None and result.retunes and ticks_since_change >= 3 and no_pressure:
                settled_at = (time.time(), a.preemptions_total)
            if settled_at is not None and time.time() - settled_at[0] >= 4:
                elapsed = time.time() - settled_at[0]
                result.summary["preemptions_per_minute_after"] = round(
                    (a.preemptions_total - settled_at[1]) * 60 / elapsed, 1)
                result.summary["after_window_seconds"] = round(elapsed, 1)
                result.summary["waiting_at_end_of_load"] = a.waiting
                break
        result.engine_a_config = asyncio.run(admin.get_max_num_seqs(engines["engine-a"].url))
        result.engine_a_gauge = engines["engine-a"].metrics()[names.MAX_NUM_SEQS]
    finally:
        loadgen.kill()
        loadgen.wait()

    engines["engine-a"].wait_metric(names.RUNNING_SEQS, lambda v: v == 0, timeout=15)
    time.sleep(1.5)  # at least one more Prometheus scrape after the load
    samples, decision = tick()
    result.after = {"waiting": {s.pod: s.waiting for s in samples}, "desired": decision.desired_replicas,
                    "reason": decision.reason, "message": decision.message}
    if prometheus:
        result.prometheus_reads.append({s.pod: s for s in asyncio.run(prom.read(endpoints))})
    (workdir / "scenario.json").write_text(json.dumps(result.ticks, indent=1, default=str))
    return result


def test_live_engines_scale_up_proposal_and_kv_retune_stop_preemptions(scenario, capsys):
    load_ticks = scenario.ticks[1:-1]
    peak = max(load_ticks, key=lambda r: (r["engine-a"] or {}).get("waiting", 0))
    up = [r for r in load_ticks if r["desired"] > 2 and r["reason"] == "waiting_above_target"]
    s = scenario.summary
    _report(capsys, f"\nautoscaler live: waiting before {scenario.before['waiting']}, "
                     f"peak {peak['engine-a']['waiting']:g} on engine-a, after {scenario.after['waiting']}")
    _report(capsys, f"autoscaler live: replica proposal 2 -> {max(r['desired'] for r in load_ticks)} "
                     f"({up[0]['reason'] if up else 'none'}); after the load: {scenario.after['desired']} "
                     f"({scenario.after['reason']})")
    _report(capsys, f"autoscaler live: max_num_seqs retunes on engine-a (t s, from, to): {scenario.retunes}; "
                     f"admin API now {scenario.engine_a_config}, gauge {scenario.engine_a_gauge:g}")
    _report(capsys, f"autoscaler live: preemptions/min on engine-a before the retune "
                     f"{s.get('preemptions_per_minute_before')}, after {s.get('preemptions_per_minute_after')} "
                     f"(over {s.get('after_window_seconds')} s, {s.get('waiting_at_end_of_load')} still waiting)")

    assert scenario.before["waiting"] == {"engine-a": 0, "engine-b": 0}
    assert up, "no scale-up proposed while the queue was above target"
    assert peak["engine-a"]["waiting"] > SETTINGS.target_waiting_per_replica * 2

    tos = [to for _, _, to in scenario.retunes]
    assert tos and tos[0] == 16 and tos == sorted(tos, reverse=True)
    assert scenario.engine_a_config == tos[-1] == scenario.engine_a_gauge
    assert 8 <= tos[-1] < 32  # 80 blocks hold 10 sequences of 8 blocks: it stops once they fit
    assert s["preemptions_per_minute_before"] > 60
    assert s["preemptions_per_minute_after"] == 0, "preemptions kept rising after the retune"
    assert s["waiting_at_end_of_load"] > 0  # the load was still on while the counter stood still

    assert scenario.after["waiting"] == {"engine-a": 0, "engine-b": 0}
    assert scenario.after["desired"] == 2  # no scale-down right after preemptions (and 300 s window)
    assert not any(r["changes"] and "engine-b" in " ".join(r["changes"]) for r in scenario.ticks)


def test_prometheus_source_reads_the_same_signals(scenario, capsys):
    assert shutil.which(PROMETHEUS), f"{PROMETHEUS} missing: run `make system-packages` (Debian package prometheus)"
    reads = scenario.prometheus_reads
    assert reads, "no Prometheus reads"
    final = reads[-1]
    direct = scenario.ticks[-1]
    _report(capsys, f"\nautoscaler prometheus: final read engine-a "
                     f"max_num_seqs {final['engine-a'].max_num_seqs}, preemptions {final['engine-a'].preemptions_total}, "
                     f"waiting {final['engine-a'].waiting}; direct scrape "
                     f"{direct['engine-a']['max_num_seqs']}, {direct['engine-a']['preemptions']}, {direct['engine-a']['waiting']}")
    for pod in ("engine-a", "engine-b"):
        assert final[pod].ok, final[pod].error
        assert final[pod].preemptions_total == direct[pod]["preemptions"]
        assert final[pod].max_num_seqs == direct[pod]["max_num_seqs"]
        assert final[pod].waiting == 0
    assert max(r["engine-a"].waiting or 0 for r in reads if r["engine-a"].ok) > SETTINGS.target_waiting_per_replica
    seen = [r["engine-a"] for r in reads if r["engine-a"].ok]
    assert {s.max_num_seqs for s in seen} >= {32, final["engine-a"].max_num_seqs}  # before and after the retune
    assert final["engine-a"].preemptions_total > 0 and final["engine-b"].preemptions_total == 0


def test_prometheus_unreachable_is_an_error_on_every_pod_that_names_it():
    url = f"http://127.0.0.1:{free_port()}"
    samples = asyncio.run(PrometheusSource(url).read([PodEndpoint("a", "x"), PodEndpoint("b", "y")]))
    assert [s.ok for s in samples] == [False, False]
    assert all(f"Prometheus at {url} unreachable" in s.error for s in samples)
    decision = decide(SETTINGS, mem.state_for(mem.record_samples(mem.Memory(), samples, ["a", "b"], SETTINGS, time.time()),
                                              2, [mem.PodInfo("a", 0, 1), mem.PodInfo("b", 0, 1)]),
                      {s.pod: [s] for s in samples}, time.time())
    assert not decision.metrics.available and "unreachable" in decision.metrics.message
    assert decision.desired_replicas == 2
