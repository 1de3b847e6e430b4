"""A simulation's result as JSON (a `requests` list, one entry per trace request, and a `summary`)
and as a timeline plot shaped like the whole loop's (e2e/wholeloop/plot.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from iterserve.simulate.cluster import Result


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.2  # on each request's mean inter-token latency


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100), None when empty."""
    if not len(values):
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def request_rows(result: Result) -> list[dict]:
    rows = []
    for r in result.requests:
        ttft = r.first_token - r.arrival if r.first_token is not None else None
        itl = (r.last_token - r.first_token) / (r.tokens - 1) if r.tokens > 1 else None
        rows.append({
            "index": r.index, "arrival_s": _r(r.arrival), "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "pod": r.pod, "status": r.status,
            "generated_tokens": r.tokens, "ttft_s": _r(ttft), "itl_mean_s": _r(itl),
            "itl_max_s": _r(r.max_gap) if r.tokens > 1 else None,
            "e2e_s": _r(r.last_token - r.arrival) if r.status == "ok" else None,
            "error": r.error, "held": r.held,
        })
    return rows


def summarize(result: Result, rows: list[dict], slo: Slo) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    ttfts = [r["ttft_s"] for r in ok]
    e2es = [r["e2e_s"] for r in ok]
    first = min((r["arrival_s"] for r in rows), default=0.0)
    last_end = max((r["arrival_s"] + r["e2e_s"] for r in ok), default=first)
    span = max(last_end - first, 1e-9)
    met = sum(1 for r in ok if r["ttft_s"] <= slo.ttft_s and (r["itl_mean_s"] or 0.0) <= slo.itl_s)
    replica_seconds = sum((p.gone_at - p.created_at) for p in result.pods)
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "requests": len(rows),
        "statuses": dict(sorted(statuses.items())),
        "simulated_seconds": _r(result.end, 3),
        "throughput": {"requests_per_s": _r(len(ok) / span, 4),
                       "output_tokens_per_s": _r(sum(r["generated_tokens"] for r in ok) / span, 3)},
        "ttft_s": {f"p{q}": _r(percentile(ttfts, q)) for q in (50, 95, 99)},
        "itl_s": {f"p{q}": _r(percentile(result.gaps, q)) for q in (50, 95, 99)},
        "e2e_s": {f"p{q}": _r(percentile(e2es, q)) for q in (50, 95, 99)},
        "slo": {"ttft_s": slo.ttft_s, "itl_mean_s": slo.itl_s,
                "attainment": _r(met / len(rows), 4) if rows else None},
        "replica_seconds": _r(replica_seconds, 3),
        "max_ready_replicas": max((row["replicas_ready"] for row in result.timeline), default=0),
        "pods_created": len(result.pods),
        "scale_events": result.scale_events,
        "retunes": result.retunes,
        "decisions": dict(sorted(result.decisions.items())),
        "preemptions": result.preemptions,
        "engine_steps": result.steps,
        # Cold starts: requests that arrived while no replica was ready and waited for one.
        "held": {"requests": sum(1 for r in rows if r["held"]),
                 "ttft_p95_s": _r(percentile([r["ttft_s"] for r in ok if r["held"]], 95))},
    }


def to_json(result: Result, slo: Slo, inputs: dict) -> dict:
    rows = request_rows(result)
    return {"inputs": inputs, "summary": summarize(result, rows, slo), "timeline": result.timeline,
            "requests": rows}


def dumps(document: dict) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n"


def plot(document: dict, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["timeline"]
    t = [r["t"] for r in rows]
    summary = document["summary"]
    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    replicas, queue, kv, clients = axes
    replicas.step(t, [r["replicas_desired"] for r in rows], where="post", lw=2, label="desired (spec.replicas)")
    replicas.step(t, [r["replicas_ready"] for r in rows], where="post", lw=2, label="ready")
    replicas.step(t, [r["pods_starting"] for r in rows], where="post", ls="--", label="starting")
    replicas.step(t, [r["pods_draining"] for r in rows], where="post", ls=":", label="draining")
    replicas.set_ylabel("replicas")

    names = sorted({n for r in rows for n in r["pods"]}, key=lambda n: int(n.split("-")[-1]))
    shown = names[:8]  # beyond eight pods the lines stop being readable; totals below cover all
    queue.plot(t, [sum(p["waiting"] for p in r["pods"].values()) + r["router_queue"] for r in rows],
               color="black", lw=2, label="waiting, all pods")
    kv_seqs = kv.twinx()
    for name in shown:
        series = [(r["t"], r["pods"][name]) for r in rows if name in r["pods"]]
        ts = [s[0] for s in series]
        line, = queue.plot(ts, [s[1]["running"] for s in series], ls="--", label=f"{name} running")
        kv.plot(ts, [s[1]["kv_usage"] for s in series], color=line.get_color(), label=f"{name} KV")
        kv_seqs.step(ts, [s[1]["max_num_seqs"] for s in series], where="post", color=line.get_color(), ls=":")
    queue.set_ylabel("waiting (solid)\nrunning (dashed)")
    kv.set_ylabel("KV usage (solid)")
    kv.set_ylim(0, 1.05)
    kv_seqs.set_ylabel("max_num_seqs (dotted)")

    _plot_arrivals_and_ttft(clients, document, t)

    for ax in axes:
        for event in summary["scale_events"]:
            ax.axvline(event["t"], color="tab:red" if event["to"] > event["from"] else "tab:green", lw=1, alpha=0.6)
        for event in summary["retunes"]:
            ax.axvline(event["t"], color="tab:purple", lw=0.8, alpha=0.5)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=4)
    fig.suptitle(f"iterserve simulate {title}\nreplica-seconds {summary['replica_seconds']:.0f}, "
                 f"SLO attainment {summary['slo']['attainment']}, p95 TTFT {summary['ttft_s']['p95']} s, "
                 f"{len(summary['scale_events'])} scale events, {summary['preemptions']} preemptions\n"
                 "lines: scale-up (red), scale-down (green), max_num_seqs retune (purple)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_arrivals_and_ttft(clients, document: dict, t: list[float]) -> None:
    requests = [r for r in document["requests"] if r["status"] == "ok"]
    width = max(1.0, (t[-1] - t[0]) / 100) if t else 1.0
    bins = [i * width for i in range(int((t[-1] if t else 0) / width) + 2)]
    arrivals = [0] * len(bins)
    ttft_bins: list[list[float]] = [[] for _ in bins]
    for r in document["requests"]:
        arrivals[min(len(bins) - 1, int(r["arrival_s"] / width))] += 1
    for r in requests:
        ttft_bins[min(len(bins) - 1, int((r["arrival_s"] + r["ttft_s"]) / width))].append(r["ttft_s"])
    clients.plot(bins, [a / width for a in arrivals], color="tab:blue", label="arrivals/s")
    clients.set_ylabel("arrivals/s")
    ttft = clients.twinx()
    ttft.plot(bins, [percentile(b, 95) if b else float("nan") for b in ttft_bins], color="tab:orange")
    ttft.set_ylabel("p95 TTFT (s)", color="tab:orange")
    clients.set_xlabel("simulated seconds")
