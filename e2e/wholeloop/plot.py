"""The run's timeline as one PNG: replicas, queue and running sequences, KV usage and
max_num_seqs per pod, preemptions per minute, request rate and p95 TTFT, with the load phases
shaded and every scaling decision marked."""

from __future__ import annotations

from pathlib import Path

from e2e.wholeloop.timeline import epoch

PHASE_COLOURS = {"idle": "#f2f2f2", "heavy": "#fde0dd", "light": "#e5f5e0"}
ACTION_COLOURS = {"ScaleUp": "tab:red", "ScaleDown": "tab:green", "RetuneDown": "tab:purple", "RetuneUp": "tab:blue"}


def plot(result: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["timeline"] if "error" not in r]
    t = [r["t"] for r in rows]
    pods = sorted({name for r in rows for name in r["pods"]}, key=lambda n: min(r["t"] for r in rows if n in r["pods"]))
    short = {name: f"pod {i + 1}" for i, name in enumerate(pods)}
    fig, axes = plt.subplots(5, 1, figsize=(12, 13), sharex=True)
    (replicas, queue, kv, preempt, clients) = axes

    replicas.step(t, [r["replicas_desired"] for r in rows], where="post", label="desired (spec.replicas)", lw=2)
    replicas.step(t, [r["replicas_ready"] for r in rows], where="post", label="ready", lw=2)
    replicas.step(t, [r["pods_terminating"] for r in rows], where="post", label="terminating (draining)", ls=":")
    replicas.set_ylabel("replicas")
    replicas.set_ylim(-0.2, result["scenario"]["max_replicas"] + 0.8)

    kv_seqs = kv.twinx()
    for name in pods:
        series = [(r["t"], r["pods"][name]) for r in rows if name in r["pods"] and r["pods"][name].get("waiting") is not None]
        if not series:
            continue
        ts = [s[0] for s in series]
        line, = queue.plot(ts, [s[1]["waiting"] for s in series], label=f"{short[name]} waiting")
        queue.plot(ts, [s[1]["running"] for s in series], ls="--", color=line.get_color(), label=f"{short[name]} running")
        kv.plot(ts, [s[1]["kv_usage"] for s in series], color=line.get_color(), label=f"{short[name]} KV usage")
        kv_seqs.step(ts, [s[1]["max_num_seqs"] for s in series], where="post", color=line.get_color(), ls=":", lw=2)
        rates = [(s[0], s[1]["preemptions_per_min"]) for s in series if s[1].get("preemptions_per_min") is not None]
        preempt.plot([r[0] for r in rates], [r[1] for r in rates], color=line.get_color(), label=short[name])
    queue.set_ylabel("waiting (solid)\nrunning (dashed)")
    kv.set_ylabel("KV usage (solid)")
    kv.axhline(0.95, color="grey", lw=0.8, ls="--")
    kv.set_ylim(0, 1.05)
    kv_seqs.set_ylabel("max_num_seqs (dotted)")
    kv_seqs.set_ylim(0, result["scenario"]["max_num_seqs"] + 1)
    preempt.set_ylabel("preemptions/min\n(20 s window)")

    plot_clients(clients, t, rows)

    for ax in axes:
        for phase, (start, end) in result["phases"].items():
            ax.axvspan(start, end, color=PHASE_COLOURS.get(phase, "white"), zorder=0)
        for record in result["decisions"]:
            ax.axvline(epoch(record["time"]) - result["started_at"], color=ACTION_COLOURS[record["action"]],
                       lw=1, alpha=0.7)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=3)
    for record in result["decisions"]:
        label = (f"{record['fromReplicas']}→{record['toReplicas']}" if record["action"].startswith("Scale")
                 else f"{short.get(record['pod'], record['pod'])} seqs {record['fromMaxNumSeqs']}→{record['toMaxNumSeqs']}")
        replicas.annotate(label, (epoch(record["time"]) - result["started_at"], replicas.get_ylim()[1] - 0.35),
                          rotation=90, fontsize=7, va="top", color=ACTION_COLOURS[record["action"]])
    fig.suptitle(f"iterserve whole loop on one machine — {summary['model'].split(' (')[0]} model, "
                 f"wall {summary['wall_seconds']:.0f} s, max ready {summary['max_ready_replicas']}, "
                 f"max_num_seqs {summary['max_num_seqs_before']}→{summary['max_num_seqs_after']}, "
                 f"failed requests {summary['failed_requests']}\n"
                 "phases shaded: idle (grey), heavy (red), light (green); lines: scale-up (red), "
                 "scale-down (green), KV retune (purple)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_clients(clients, t: list[float], rows: list[dict]) -> None:
    """The clients' panel both whole-loop plots share: completed requests/s and p95 TTFT."""
    clients.plot(t, [r["request_rate"] for r in rows], color="tab:blue", label="completed req/s (5 s window)")
    clients.set_ylabel("req/s")
    ttft = clients.twinx()
    ttft.plot(t, [r["ttft_p95_s"] for r in rows], color="tab:orange", label="p95 TTFT (s)")
    ttft.set_ylabel("p95 TTFT (s)", color="tab:orange")
    clients.set_xlabel("seconds since the InferenceService was applied")
