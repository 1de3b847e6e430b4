"""The chart's PrometheusRule: promtool checks it and runs its unit tests; every alert is tested,
documented in a runbook section that exists, and names only metrics iterserve exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from iterserve.engine import metrics
from tests.unit.chart_tools import ROOT, of_kind, promtool_path, render

pytestmark = pytest.mark.cluster  # needs helm from `make cluster-tools`

PROMTOOL_TESTS = Path(__file__).resolve().parent / "chart_alerts" / "alerts_test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
EXPORTED = set(metrics.ENGINE_METRIC_NAMES) | set(metrics.OPERATOR_METRIC_NAMES)
ALERTS = {"IterserveSchedulerBacklog", "IterservePreemptionStorm", "IterserveKVCacheNearExhaustion",
          "IterserveEngineTargetDown", "IterserveEngineMetricsAbsent", "IterserveTTFTSLOBreach",
          "IterserveAutoscalerPinnedAtMax"}


def rendered_rules(values=("monitoring.yaml",), sets=()) -> dict:
    [rule] = of_kind(render(values, sets), "PrometheusRule")
    return rule["spec"]


def alert_rules(spec: dict) -> dict[str, dict]:
    return {rule["alert"]: rule for group in spec["groups"] for rule in group["rules"]}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_path(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def write_rules(spec: dict, folder: Path) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def github_anchors(markdown: str) -> dict[str, str]:
    """Heading anchor (as GitHub renders it) -> the section's text."""
    sections, anchor = {}, None
    for line in markdown.splitlines():
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            sections[anchor] = ""
        elif anchor is not None:
            sections[anchor] += line + "\n"
    return sections


@pytest.fixture(scope="module")
def default_rules() -> dict:
    return rendered_rules()


def test_chart_rules_pass_promtool_check(default_rules, tmp_path):
    rules = write_rules(default_rules, tmp_path)
    result = promtool("check", "rules", str(rules), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_chart_alerts_fire_and_stay_quiet_in_promtool_unit_tests(default_rules, tmp_path):
    write_rules(default_rules, tmp_path)
    shutil.copy(PROMTOOL_TESTS, tmp_path / PROMTOOL_TESTS.name)
    result = promtool("test", "rules", PROMTOOL_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_chart_promtool_tests_cover_every_alert_both_ways(default_rules):
    assert set(alert_rules(default_rules)) == ALERTS
    fired, quiet = set(), set()
    for case in yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fired == ALERTS, f"no firing case for {ALERTS - fired}"
    assert quiet == ALERTS, f"no quiet case for {ALERTS - quiet}"


def test_chart_promtool_catches_a_wrong_threshold(tmp_path):
    """The unit tests are not vacuous: a backlog threshold of 51 must fail them."""
    write_rules(rendered_rules(sets=("alerts.schedulerBacklog.threshold=51",)), tmp_path)
    shutil.copy(PROMTOOL_TESTS, tmp_path / PROMTOOL_TESTS.name)
    result = promtool("test", "rules", PROMTOOL_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "IterserveSchedulerBacklog" in result.stdout + result.stderr


def test_chart_alerts_are_documented_with_runbooks(default_rules):
    sections = github_anchors(RUNBOOKS.read_text())
    for name, rule in alert_rules(default_rules).items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        annotations = rule["annotations"]
        assert annotations["summary"] and "$labels.inferenceservice" in annotations["summary"] + annotations["description"], name
        assert "$value" in annotations["description"] or "$labels" in annotations["description"], name
        url = urlparse(annotations["runbook_url"])
        assert url.path.endswith("/docs/runbooks.md"), annotations["runbook_url"]
        assert url.fragment in sections, f"{name}: docs/runbooks.md has no section #{url.fragment}"
        section = sections[url.fragment]
        assert "**What to do**" in section and "**Fires when**" in section, f"{name}: runbook section lacks what to do"


def test_chart_alerts_name_only_exported_metrics(default_rules):
    for name, rule in alert_rules(default_rules).items():
        tokens = set(re.findall(r"\b(?:llm_|iterserve_|vllm:)[A-Za-z0-9_:]+", rule["expr"]))
        names = {token.removesuffix("_bucket") for token in tokens}
        assert names or rule["expr"].startswith("up{"), f"{name} names no iterserve metric"
        assert names <= EXPORTED, f"{name} uses {sorted(names - EXPORTED)}, not in iterserve.engine.metrics"


def test_chart_alert_thresholds_come_from_values(tmp_path):
    spec = rendered_rules(("namespaced-monitoring.yaml",))
    rules = alert_rules(spec)
    backlog = rules["IterserveSchedulerBacklog"]
    assert backlog["expr"].endswith("> 100") and backlog["for"] == "10m"
    assert "(threshold 100) for 10m" in backlog["annotations"]["description"]
    assert rules["IterserveTTFTSLOBreach"]["expr"].endswith("> 0.5")
    assert all(rule["labels"]["team"] == "ml-platform" for rule in rules.values())
    result = promtool("check", "rules", str(write_rules(spec, tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    disabled = alert_rules(rendered_rules(sets=("alerts.engineTargetDown.enabled=false",)))
    assert set(disabled) == ALERTS - {"IterserveEngineTargetDown"}
