"""The Grafana dashboard names only metrics the engine and the operator really export."""

from __future__ import annotations

import json
import re

import pytest

from iterserve.engine import metrics
from tests.unit.chart_tools import CHART, of_kind, render

DASHBOARD = CHART / "dashboards" / "iterserve.json"
EXPORTED = set(metrics.ENGINE_METRIC_NAMES) | set(metrics.OPERATOR_METRIC_NAMES)
# Series a histogram or counter adds to its name in the exposition format.
SUFFIXES = ("_bucket", "_count", "_sum", "_created")
# Anything that looks like one of ours: llm_..., iterserve_..., vllm:...
METRIC_TOKEN = re.compile(r"\b(?:llm_|iterserve_|vllm:)[A-Za-z0-9_:]+")


def base_name(token: str) -> str:
    for suffix in SUFFIXES:
        if token.endswith(suffix) and token[: -len(suffix)] in EXPORTED:
            return token[: -len(suffix)]
    return token


def metric_names(expr: str) -> set[str]:
    return {base_name(token) for token in METRIC_TOKEN.findall(expr)}


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    return found


def test_chart_dashboard_queries_name_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    found = queries(dashboard)
    assert len(found) >= 10
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where} names no iterserve metric: {expr}"
        unknown = names - EXPORTED
        assert not unknown, f"{where} uses {sorted(unknown)}, not in iterserve.engine.metrics: {expr}"


def test_chart_dashboard_shows_the_design_note_signals():
    used = set().union(*(metric_names(expr) for _, expr in queries(json.loads(DASHBOARD.read_text()))))
    for name in (metrics.WAITING_REQUESTS, metrics.RUNNING_SEQS, metrics.PREEMPTIONS_TOTAL,
                 metrics.KV_CACHE_USAGE, metrics.THROUGHPUT_TOKENS_PER_SECOND, metrics.TIME_TO_FIRST_TOKEN,
                 metrics.AUTOSCALER_DESIRED_REPLICAS, metrics.EFFECTIVE_MAX_NUM_SEQS):
        assert name in used, f"the dashboard has no panel on {name}"


def test_chart_dashboard_panels_do_not_overlap():
    cells = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        assert pos["x"] + pos["w"] <= 24


def test_chart_metric_name_check_catches_a_rename():
    assert metric_names("rate(llm_scheduler_preemption_total[5m])") - EXPORTED == {"llm_scheduler_preemption_total"}
    assert metric_names("histogram_quantile(0.9, rate(llm_time_to_first_token_seconds_bucket[5m]))") <= EXPORTED


@pytest.mark.cluster  # needs helm from `make cluster-tools`
def test_chart_dashboard_configmap_carries_the_json_for_the_sidecar():
    [configmap] = of_kind(render(("monitoring.yaml",)), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["iterserve.json"]) == json.loads(DASHBOARD.read_text())
