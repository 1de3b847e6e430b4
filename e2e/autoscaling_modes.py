"""Builtin vs External autoscaling on the whole loop's load, measured side by side (docs/operator.md,
"Builtin or External").

One local control plane, one Prometheus (the chart's PodMonitor as a kubernetes_sd scrape job) and
one prometheus-adapter registered with the API server's aggregation layer; then the whole loop
(e2e/wholeloop: the same InferenceService, KV pool and idle -> heavy -> light phases) runs twice:

  Builtin   the operator scales on its own readings of the engines (targetWaitingPerReplica,
            scaleDown window) and retunes max_num_seqs under KV pressure.
  External  the same spec with autoscaling.mode External; the chart's HorizontalPodAutoscaler
            (externalScaling.hpa, same target and scale-down window) scales the InferenceService
            through its scale subresource on the external metric iterserve_waiting_requests that
            prometheus-adapter serves from Prometheus. The operator writes no replicas.
  External+running  the same HPA with externalScaling.targetRunningPerReplica = max_num_seqs: a
            second metric, iterserve_running_sequences, keeps the replicas the load runs on.

    python e2e/autoscaling_modes.py [--quick] [--json PATH] [--plot PNG] [--workdir DIR]

Prints, per mode: seconds from the start of the heavy phase to the first scale-up and to two ready
replicas, peak replicas, seconds from the end of the heavy phase back to one replica, the queue
(peak, mean and waiting-request-seconds while heavy), heavy-phase p95 TTFT, failed requests and
ready-replica-seconds. The JSON holds both timelines; the plot overlays replicas, queue and p95
TTFT with the heavy phase's start at 0. The HPA controller runs with kube-controller-manager's
default 15 s sync period, as in a real cluster.

Needs `make cluster-tools` (control plane, helm, prometheus, prometheus-adapter) and `make
system-packages` (Alertmanager: the monitoring harness starts it beside Prometheus).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `e2e` as a package when run as a script

from e2e.wholeloop.run import run  # noqa: E402
from e2e.wholeloop.scenario import NAME, Scenario  # noqa: E402
from e2e.wholeloop.timeline import percentile  # noqa: E402
from iterserve.devcluster import LocalCluster  # noqa: E402
from iterserve.devcluster.adapter import PrometheusAdapter  # noqa: E402
from iterserve.devcluster.monitoring import CHART, ChartAlerting, render_chart  # noqa: E402
from iterserve.machine import cpu_model  # noqa: E402
from iterserve.operator.models import GROUP, PLURAL, VERSION  # noqa: E402

MODES = ("Builtin", "External", "External+running")
DEFAULT_MODES = ("Builtin", "External")
MONITORING_NAMESPACE = "autoscaling-modes-monitoring"


def chart_hpa(namespace: str, scenario: Scenario, running: float | None = None) -> dict:
    """The chart's HorizontalPodAutoscaler for InferenceService NAME in `namespace`, with the
    scenario's target and scale-down window (what the Builtin run's spec asks of the operator),
    and with `running` as externalScaling.targetRunningPerReplica when given."""
    sets = (*([f"externalScaling.targetRunningPerReplica={running:g}"] if running else []),"externalScaling.hpa.enabled=true", f"externalScaling.targets[0].name={NAME}",
            f"externalScaling.targets[0].namespace={namespace}",
            f"externalScaling.targets[0].minReplicas={scenario.min_replicas}",
            f"externalScaling.targets[0].maxReplicas={scenario.max_replicas}",
            f"externalScaling.targetWaitingPerReplica={scenario.target_waiting_per_replica:g}",
            f"externalScaling.hpa.behavior.scaleDown.stabilizationWindowSeconds={scenario.scale_down_window_seconds}")
    [hpa] = [o for o in render_chart(sets) if o["kind"] == "HorizontalPodAutoscaler"]
    return hpa


class HpaInstaller:
    """Applies the chart's HPA next to every External-mode InferenceService NAME that appears (the
    whole loop creates its namespace and InferenceService itself), as `helm upgrade` with
    externalScaling.targets would."""

    def __init__(self, cluster, scenario: Scenario, running: float | None = None):
        self.cluster, self.scenario, self.running = cluster, scenario, running
        self.installed: dict[str, float] = {}  # namespace -> time.time() applied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpa installer", daemon=True)

    def __enter__(self) -> HpaInstaller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        from kubernetes import client

        api = self.cluster.api_client()
        custom = client.CustomObjectsApi(api)
        try:
            while not self._stop.is_set():
                try:
                    items = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
                except Exception:  # noqa: BLE001 - CRD not served yet: try again
                    items = []
                for item in items:
                    namespace = item["metadata"]["namespace"]
                    mode = (item["spec"].get("autoscaling") or {}).get("mode")
                    if item["metadata"]["name"] == NAME and mode == "External" and namespace not in self.installed:
                        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(chart_hpa(namespace, self.scenario, self.running)))
                        self.installed[namespace] = time.time()
                self._stop.wait(0.5)
        finally:
            api.close()


def _first(rows: list[dict], start: float, predicate) -> float | None:
    return next((round(r["t"] - start, 1) for r in rows if r["t"] >= start and predicate(r)), None)


def summarize(result: dict) -> dict:
    """The figures the docs compare, from one whole-loop run's timeline."""
    scenario = result["scenario"]
    rows = [r for r in result["timeline"] if "error" not in r]
    heavy_start, heavy_end = result["phases"]["heavy"]
    lowest = scenario["min_replicas"]
    heavy = [r for r in rows if heavy_start <= r["t"] <= heavy_end]
    waiting = [r["waiting_total"] or 0 for r in heavy]
    # back at min: where the last stretch at min replicas began, from the heavy phase's end
    # (negative: the scaler went back to min while the heavy load still ran)
    above = [i for i, r in enumerate(rows) if r["replicas_desired"] != lowest]
    back = (round(rows[above[-1] + 1]["t"] - heavy_end, 1) if above and above[-1] + 1 < len(rows)
            and above[-1] >= 0 and any(r["t"] >= heavy_start for r in rows[:above[-1] + 1]) else None)
    # the first drop of spec.replicas while the heavy load still ran
    drops = [b["t"] - heavy_start for a, b in zip(heavy, heavy[1:], strict=False)
             if (b["replicas_desired"] or 0) < (a["replicas_desired"] or 0)]
    requests = result["requests"]
    heavy_ttft = [r["ttft"] for r in requests if r["ttft"] is not None
                  and heavy_start <= r["start"] - result["started_at"] <= heavy_end]
    dt = [(b["t"] - a["t"], a) for a, b in zip(rows, rows[1:], strict=False)]
    preemptions = 0.0  # per pod: its counter's rise while heavy
    for pod in {name for r in heavy for name in r["pods"]}:
        counts = [r["pods"][pod]["preemptions_total"] for r in heavy
                  if r["pods"].get(pod, {}).get("preemptions_total") is not None]
        preemptions += counts[-1] - counts[0] if counts else 0
    return {
        "first_scale_up_after_heavy_start_s": _first(rows, heavy_start, lambda r: (r["replicas_desired"] or 0) > lowest),
        "two_ready_after_heavy_start_s": _first(rows, heavy_start, lambda r: r["replicas_ready"] >= 2),
        "peak_replicas_desired": max((r["replicas_desired"] or 0) for r in rows),
        "peak_replicas_ready": max(r["replicas_ready"] for r in rows),
        "back_to_min_after_heavy_end_s": back,
        "first_scale_down_during_heavy_s": round(drops[0], 1) if drops else None,
        "heavy_waiting_peak": max(waiting, default=None),
        "heavy_waiting_mean": round(sum(waiting) / len(waiting), 1) if waiting else None,
        "heavy_waiting_request_seconds": round(sum(d * (a["waiting_total"] or 0) for d, a in dt
                                                   if heavy_start <= a["t"] <= heavy_end), 1),
        "heavy_preemptions": int(preemptions),
        "heavy_ttft_p95_s": round(percentile(heavy_ttft, 0.95), 2) if heavy_ttft else None,
        "requests_ok": sum(1 for r in requests if r["ok"]),
        "requests_failed": sum(1 for r in requests if not r["ok"]),
        "ready_replica_seconds": round(sum(d * a["replicas_ready"] for d, a in dt), 1),
        "scale_decisions": [f"{d['action']} {d.get('fromReplicas')}->{d.get('toReplicas')}" for d in result["decisions"]
                            if d["action"].startswith("Scale")],
        "max_num_seqs_retunes": [f"{d['fromMaxNumSeqs']}->{d['toMaxNumSeqs']}" for d in result["decisions"]
                                 if d["action"].startswith("Retune")],
        "wall_seconds": result["wall_seconds"],
    }


def plot(results: dict[str, dict], summaries: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"Builtin": "tab:blue", "External": "tab:orange", "External+running": "tab:green"}
    fig, (replicas, queue, ttft) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for mode, result in results.items():
        rows = [r for r in result["timeline"] if "error" not in r]
        heavy_start, heavy_end = result["phases"]["heavy"]
        t = [r["t"] - heavy_start for r in rows]
        colour = colours[mode]
        replicas.step(t, [r["replicas_desired"] for r in rows], where="post", color=colour, lw=2,
                      label=f"{mode}: desired (spec.replicas)")
        replicas.step(t, [r["replicas_ready"] for r in rows], where="post", color=colour, lw=1, ls="--",
                      label=f"{mode}: ready")
        queue.plot(t, [r["waiting_total"] for r in rows], color=colour, label=f"{mode}: waiting, all engines")
        ttft.plot(t, [r["ttft_p95_s"] for r in rows], color=colour, label=f"{mode}: p95 TTFT (5 s window)")
        for ax in (replicas, queue, ttft):
            ax.axvline(heavy_end - heavy_start, color=colour, lw=0.8, ls=":")
    for ax in (replicas, queue, ttft):
        ax.axvspan(0, min(r["phases"]["heavy"][1] - r["phases"]["heavy"][0] for r in results.values()),
                   color="#fde0dd", zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    scenario = next(iter(results.values()))["scenario"]
    replicas.set_ylabel("replicas")
    replicas.set_ylim(-0.2, scenario["max_replicas"] + 0.8)
    queue.set_ylabel("waiting requests")
    ttft.set_ylabel("p95 TTFT (s)")
    ttft.set_xlabel("seconds since the heavy phase started (shaded: heavy; dotted: its end in each run)")
    line = "\n".join(f"{mode}: up +{s['first_scale_up_after_heavy_start_s']} s, 2 ready +{s['two_ready_after_heavy_start_s']} s"
                      + (f", down while heavy +{s['first_scale_down_during_heavy_s']} s"
                         if s["first_scale_down_during_heavy_s"] is not None else "")
                      + f", at 1 from heavy end {s['back_to_min_after_heavy_end_s']:+} s; "
                      f"waiting req-s {s['heavy_waiting_request_seconds']:.0f}, p95 TTFT {s['heavy_ttft_p95_s']} s (heavy)"
                      for mode, s in summaries.items())
    fig.suptitle(f"Builtin vs External (HPA via prometheus-adapter) on the whole loop's load: "
                 f"{scenario['heavy_rate']:g} req/s for {scenario['heavy_seconds']:g} s, target "
                 f"{scenario['target_waiting_per_replica']:g} waiting/replica, scale-down window "
                 f"{scenario['scale_down_window_seconds']} s\n{line}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the whole loop's short shape (~3 min a mode)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write both timelines and the figures here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw both timelines here")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    parser.add_argument("--workdir", type=Path, help="cluster, operator, pod and monitoring logs (default: a temp folder)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    base = Scenario() if args.quick else Scenario.full()  # --quick: 75 s of load (the whole loop's CI run has 50)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="autoscaling-modes-"))
    print(f"autoscaling modes: logs under {workdir}")
    results: dict[str, dict] = {}
    with LocalCluster(workdir / "cluster") as cluster:
        handle = cluster.cluster_handle()
        rules = yaml.safe_load((CHART / "examples" / "prometheus-adapter.yaml").read_text())
        with ChartAlerting(handle, workdir / "monitoring", namespace=MONITORING_NAMESPACE) as monitoring, \
                PrometheusAdapter(handle, workdir, monitoring.prometheus.url, rules, namespace=MONITORING_NAMESPACE):
            for mode in modes:
                # answer_wait_seconds 0: every mode gets the same load, however it answers.
                scenario = replace(base, autoscaling_mode=mode.split("+")[0], answer_wait_seconds=0)
                print(f"{mode}: running the whole loop")
                if scenario.autoscaling_mode == "External":
                    running = scenario.max_num_seqs if mode == "External+running" else None
                    with HpaInstaller(handle, scenario, running) as installer:
                        results[mode] = run(handle, workdir / mode.lower(), scenario)
                    results[mode]["hpa_namespaces"] = sorted(installer.installed)
                else:
                    results[mode] = run(handle, workdir / mode.lower(), scenario)
    summaries = {mode: summarize(result) for mode, result in results.items()}
    for mode, summary in summaries.items():
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    if args.json:
        machine = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
        args.json.write_text(json.dumps({"command": "python e2e/autoscaling_modes.py " + " ".join(argv or sys.argv[1:]),
                                         "machine": machine, "summaries": summaries, "runs": results}, indent=1))
        print(f"json: {args.json}")
    if args.plot and results:
        plot(results, summaries, args.plot)
        print(f"plot: {args.plot}")
    failed = [mode for mode, s in summaries.items() if s["two_ready_after_heavy_start_s"] is None
              or s["back_to_min_after_heavy_end_s"] is None]
    if failed:
        print(f"FAIL: {', '.join(failed)} did not scale up to two ready replicas and back to one")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
