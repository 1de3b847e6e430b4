"""The chart's Prometheus Operator objects against the real CRDs: the pinned upstream manifests
(github.com/prometheus-operator/prometheus-operator, example/prometheus-operator-crd, from the Go
module cache) installed into the test control plane; `helm install` with every monitoring switch
on succeeds, and each PodMonitor, ServiceMonitor and PrometheusRule reads back exactly as the chart
rendered it (nothing pruned or rewritten by the CRDs' schemas). The same for the KEDA ScaledObject
(externalScaling.keda) against KEDA's own CRD (github.com/kedacore/keda/v2, config/crd/bases), and
the HorizontalPodAutoscaler (externalScaling.hpa) is accepted by the API server."""

from __future__ import annotations

import json

import pytest
import yaml

from iterserve.devcluster.monitoring import (
    PROMETHEUS_OPERATOR_VERSION,
    keda_scaledobject_crd,
    prometheus_operator_crds,
)
from tests.operator_fixture import wait_for
from tests.unit.chart_tools import CHART, VALUES_DIR, helm, render

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "iterserve-mon"
NAMESPACE = "iterserve-monitoring"
MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule", "ScaledObject")
CRDS = ("podmonitors.monitoring.coreos.com", "servicemonitors.monitoring.coreos.com",
        "prometheusrules.monitoring.coreos.com", "scaledobjects.keda.sh")
TARGET = ("externalScaling.targets[0].name=chat", f"externalScaling.targets[0].namespace={NAMESPACE}",
          "externalScaling.targets[0].maxReplicas=4")


def established(cluster, name: str) -> bool:
    return cluster.kubectl("get", "crd", name, "-o",
                           "jsonpath={.status.conditions[?(@.type=='Established')].status}", check=False).stdout == "True"


@pytest.fixture(scope="module")
def installed(k8s_cluster):
    cluster = k8s_cluster
    for path in [*prometheus_operator_crds(), keda_scaledobject_crd()]:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120)
    for name in CRDS:
        wait_for(lambda name=name: established(cluster, name), 60, 0.5, f"{name} established")
    kubeconfig = str(cluster.kubeconfig)
    helm("install", RELEASE, str(CHART), "--kubeconfig", kubeconfig, "--namespace", NAMESPACE, "--create-namespace",
         "-f", str(VALUES_DIR / "monitoring.yaml"), "--set", "monitoring.podMonitor.labels.release=kps",
         "--set", "alerts.additionalLabels.team=ml-platform", "--set", "externalScaling.keda.enabled=true",
         "--set", "externalScaling.targetRunningPerReplica=8",  # the ScaledObject's second trigger
         *[arg for item in TARGET for arg in ("--set", item)])
    manifest = helm("get", "manifest", RELEASE, "--kubeconfig", kubeconfig, "--namespace", NAMESPACE).stdout
    yield cluster, [doc for doc in yaml.safe_load_all(manifest) if doc]
    helm("uninstall", RELEASE, "--kubeconfig", kubeconfig, "--namespace", NAMESPACE)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_the_crds_are_the_pinned_upstream_ones(installed):
    cluster, _ = installed
    crd = json.loads(cluster.kubectl("get", "crd", "podmonitors.monitoring.coreos.com", "-o", "json").stdout)
    assert crd["metadata"]["annotations"]["operator.prometheus.io/version"] == PROMETHEUS_OPERATOR_VERSION.lstrip("v")
    assert crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_every_monitoring_object_is_accepted_and_reads_back_unchanged(installed):
    cluster, rendered = installed
    objects = [doc for doc in rendered if doc["kind"] in MONITORING_KINDS]
    assert sorted(doc["kind"] for doc in objects) == sorted(MONITORING_KINDS)
    for doc in objects:
        group = "keda.sh" if doc["kind"] == "ScaledObject" else "monitoring.coreos.com"
        live = json.loads(cluster.kubectl("-n", NAMESPACE, "get", f"{doc['kind'].lower()}.{group}",
                                          doc["metadata"]["name"], "-o", "json").stdout)
        assert live["spec"] == doc["spec"], f"{doc['kind']} {doc['metadata']['name']} changed on the way through the API"
        assert doc["metadata"]["labels"].items() <= live["metadata"]["labels"].items()


def test_the_crds_really_validate(installed):
    """Not vacuous: the same PodMonitor with a field of the wrong type is refused."""
    cluster, rendered = installed
    [podmonitor] = [doc for doc in rendered if doc["kind"] == "PodMonitor"]
    bad = json.loads(json.dumps(podmonitor))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["podMetricsEndpoints"][0]["relabelings"] = "not a list"
    result = cluster.kubectl("-n", NAMESPACE, "apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert result.returncode != 0 and "relabelings" in result.stderr, result.stderr


def test_the_hpa_option_renders_an_hpa_the_api_server_accepts(installed):
    cluster, _ = installed
    [hpa] = [o for o in render((), ("externalScaling.hpa.enabled=true", *TARGET)) if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService",
                                             "name": "chat"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": "iterserve_waiting_requests",
                                            "selector": {"matchLabels": {"inferenceservice": "chat"}}}
    result = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(hpa))
    assert json.loads(result.stdout)["spec"]["metrics"] == hpa["spec"]["metrics"]


def test_target_running_per_replica_adds_a_second_metric(installed):
    cluster, rendered = installed
    [hpa] = [o for o in render((), ("externalScaling.hpa.enabled=true", "externalScaling.targetRunningPerReplica=8",
                                    *TARGET)) if o["kind"] == "HorizontalPodAutoscaler"]
    waiting, running = hpa["spec"]["metrics"]
    assert waiting["external"]["metric"]["name"] == "iterserve_waiting_requests"
    assert running["external"] == {"metric": {"name": "iterserve_running_sequences",
                                              "selector": {"matchLabels": {"inferenceservice": "chat"}}},
                                   "target": {"type": "AverageValue", "averageValue": "8"}}
    result = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(hpa))
    assert json.loads(result.stdout)["spec"]["metrics"] == hpa["spec"]["metrics"]
    [scaled] = [doc for doc in rendered if doc["kind"] == "ScaledObject"]  # installed with the option on
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert [q.split("{")[0] for q in queries] == ["sum(llm_scheduler_waiting_requests", "sum(llm_scheduler_running_seqs"]
    assert scaled["spec"]["triggers"][1]["metadata"]["threshold"] == "8"
