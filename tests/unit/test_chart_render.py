"""helm lint and helm template of charts/iterserve: default values and a non-default values file."""

from __future__ import annotations

import pytest

from tests.unit.chart_tools import CHART, helm, of_kind, render, values_args

pytestmark = pytest.mark.cluster  # needs helm from `make cluster-tools`

DEFAULT = ()
NAMESPACED = ("namespaced-monitoring.yaml",)
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of", "app.kubernetes.io/component")


@pytest.mark.parametrize("values", [DEFAULT, NAMESPACED], ids=["default", "namespaced-monitoring"])
def test_chart_lints_clean(values):
    result = helm("lint", "--strict", str(CHART), *values_args(values))
    assert "0 chart(s) failed" in result.output, result.output


@pytest.mark.parametrize("values", [DEFAULT, NAMESPACED], ids=["default", "namespaced-monitoring"])
def test_chart_renders_named_objects_with_recommended_labels(values):
    objects = render(values)
    assert objects
    for obj in objects:
        where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), where
        labels = obj["metadata"].get("labels", {})
        missing = [key for key in RECOMMENDED_LABELS if key not in labels]
        assert not missing, f"{where} lacks {missing}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm", where


def test_chart_default_objects():
    objects = render()
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]


def test_chart_namespaced_objects():
    objects = render(NAMESPACED)
    kinds = sorted({obj["kind"] for obj in objects})
    assert kinds == ["ClusterRole", "ConfigMap", "Deployment", "InferenceService", "PodMonitor", "PrometheusRule",
                     "Role", "RoleBinding", "Service", "ServiceAccount", "ServiceMonitor",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    roles = of_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    for binding in of_kind(objects, "RoleBinding"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-operator"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-operator", "namespace": "iterserve-system"}]
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "ml-platform"
    [pod_monitor] = of_kind(objects, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    [sample] = of_kind(objects, "InferenceService")
    assert sample["metadata"]["namespace"] == "team-a"


def test_chart_operator_deployment_is_restricted_and_probed():
    [deployment] = of_kind(render(NAMESPACED), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "registry.example.com/iterserve/iterserve:0.1.0-rc1"
    assert deployment["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == "llm-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    health_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--liveness=http://0.0.0.0:{health_port}/healthz" in container["args"]
    assert container["args"][:2] == ["operator", "run"]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert "--peering=llm-operator" in container["args"] and "--verbose" in container["args"]
    assert container["resources"]["requests"]["cpu"]
    assert {"name": "ITERSERVE_EXTRA", "value": "1"} in container["env"]


def test_chart_cluster_mode_watches_all_namespaces():
    [deployment] = of_kind(render(), "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/iterserve/engine:0.1.0"  # the chart's appVersion
    args = container["args"]
    assert "--all-namespaces" in args
    assert not any(arg.startswith(("--namespace=", "--peering", "--verbose")) for arg in args)


def test_chart_sample_is_a_valid_inference_service():
    from iterserve.operator.models import InferenceService

    [sample] = of_kind(render(sets=("sample.enabled=true", "sample.maxReplicas=5")), "InferenceService")
    parsed = InferenceService.model_validate(sample)
    assert parsed.spec.autoscaling.max_replicas == 5
    assert parsed.spec.model.uri == "smollm2-135m"


@pytest.mark.parametrize(("flag", "item", "expected"), [
    ("--set", "operator.replicas=two", "at '/operator/replicas': got string, want integer"),
    ("--set", "operator.watch.mode=everywhere", "at '/operator/watch/mode': value must be one of 'cluster', 'namespaced'"),
    ("--set-json", "alerts.kvCacheNearExhaustion.threshold=1.5", "at '/alerts/kvCacheNearExhaustion/threshold': maximum"),
    ("--set", "alerts.schedulerBacklog.for=5min", "at '/alerts/schedulerBacklog/for': '5min' does not match"),
    ("--set", "operator.imagePullPolicy=Always", "at '/operator': additional properties 'imagePullPolicy' not allowed"),
])
def test_chart_schema_rejects_bad_values(flag, item, expected):
    result = helm("template", "iterserve", str(CHART), flag, item, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.output, result.output
    assert expected in result.output, result.output


def test_chart_namespaced_mode_needs_namespaces():
    result = helm("template", "iterserve", str(CHART), "--set", "operator.watch.mode=namespaced", check=False)
    assert result.returncode != 0
    assert "at '/operator/watch/namespaces': minItems: got 0, want 1" in result.output, result.output


def test_chart_several_operator_replicas_need_peering():
    result = helm("template", "iterserve", str(CHART), "--set", "operator.replicas=2", check=False)
    assert result.returncode != 0
    assert "operator.peering.enabled" in result.output, result.output


def test_chart_operator_args_parse_with_the_real_cli():
    """Every flag the chart passes is one `iterserve operator run` accepts."""
    from iterserve.cli import build_parser
    from iterserve.operator import cli as operator_cli

    for values in (DEFAULT, NAMESPACED):
        [deployment] = of_kind(render(values), "Deployment")
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        parser, subparsers = build_parser()
        operator_cli.configure(subparsers.add_parser("operator"))
        args = parser.parse_args(container["args"])
        assert args.operator_command == "run"
        assert args.metrics_port == 9090


def test_chart_admission_policy_binds_where_the_operator_watches_and_honours_allow():
    objects = render(sets=("operator.watch.mode=namespaced", "operator.watch.namespaces={team-a,team-b}",
                           "admissionPolicy.allow={hostPath,serviceAccount}"))
    [policy] = of_kind(objects, "ValidatingAdmissionPolicy")
    [binding] = of_kind(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]
    messages = " ".join(v["message"] for v in policy["spec"]["validations"])
    assert "hostNetwork" in messages and "privileged" in messages
    assert "hostPath" not in messages and "serviceAccountName" not in messages
    [deployment] = of_kind(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--allow-pod-security=hostPath" in args and "--allow-pod-security=serviceAccount" in args
    assert not of_kind(render(sets=("admissionPolicy.enabled=false",)), "ValidatingAdmissionPolicy")
    from iterserve.operator.podsecurity import RULE_NAMES

    everything = "{" + ",".join(RULE_NAMES) + "}"
    refused = helm("template", "x", str(CHART), "--set", f"admissionPolicy.allow={everything}", check=False)
    assert refused.returncode != 0 and "admissionPolicy.enabled=false" in refused.output
