"""`helm install` of charts/iterserve into the test control plane: the API server accepts every
object (CRD, RBAC, Deployment, the sample InferenceService), the operator's ServiceAccount can
make exactly the calls in operator/rbac.py in the watched namespace and nowhere else, and the real
operator running as that ServiceAccount serves the chart's sample."""

from __future__ import annotations

import pytest

from iterserve.operator import rbac
from tests.operator_fixture import OperatorProcess, wait_for
from tests.unit.chart_tools import CHART, helm

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "iterserve"
NAMESPACE = "iterserve-system"
WATCHED = "chart-team-a"
UNWATCHED = "chart-team-b"


def can(api, verb: str, group: str, resource: str, namespace: str | None) -> bool:
    from kubernetes import client

    name, _, subresource = resource.partition("/")
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, group=group, resource=name, subresource=subresource or None, namespace=namespace)))
    return client.AuthorizationV1Api(api).create_self_subject_access_review(review).status.allowed


@pytest.fixture(scope="module")
def installed(k8s_cluster):
    for namespace in (WATCHED, UNWATCHED):
        k8s_cluster.kubectl("create", "namespace", namespace)
    kubeconfig = str(k8s_cluster.kubeconfig)
    helm("install", RELEASE, str(CHART), "--kubeconfig", kubeconfig, "--namespace", NAMESPACE,
         "--create-namespace", "--set", "operator.watch.mode=namespaced",
         "--set", f"operator.watch.namespaces={{{WATCHED}}}", "--set", "sample.enabled=true")
    yield k8s_cluster
    helm("uninstall", RELEASE, "--kubeconfig", kubeconfig, "--namespace", NAMESPACE)
    for namespace in (WATCHED, UNWATCHED):
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_chart_installs_crd_operator_and_sample(installed):
    crd = installed.kubectl("get", "crd", "inferenceservices.iterserve.dev", "-o",
                            "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
    assert crd == "True"
    installed.kubectl("-n", NAMESPACE, "get", "deployment/iterserve", "serviceaccount/iterserve")
    sample = installed.kubectl("-n", WATCHED, "get", "infsvc", "smollm2", "-o",
                               "jsonpath={.spec.autoscaling.maxReplicas}").stdout
    assert sample == "3"
    status = helm("status", RELEASE, "--kubeconfig", str(installed.kubeconfig), "--namespace", NAMESPACE).stdout
    assert "STATUS: deployed" in status and "Create your first InferenceService" in status


def test_chart_service_account_has_exactly_the_operator_permissions(installed):
    kubeconfig = installed.service_account_kubeconfig("iterserve", NAMESPACE)
    with installed.api_client(kubeconfig) as api:
        for group, resource, verb in sorted(rbac.permissions()):
            assert can(api, verb, group, resource, WATCHED), f"cannot {verb} {group}/{resource} in {WATCHED}"
            assert not can(api, verb, group, resource, UNWATCHED), f"may {verb} {group}/{resource} in {UNWATCHED}"
        for group, resource, verb in [("", "secrets", "list"), ("", "secrets", "delete"), ("apps", "deployments", "delete"),
                                      ("", "pods/exec", "create"), ("rbac.authorization.k8s.io", "roles", "create")]:
            assert not can(api, verb, group, resource, WATCHED), f"may {verb} {group}/{resource}"
        assert not can(api, "list", "", "nodes", None)
        assert not can(api, "create", "apiextensions.k8s.io", "customresourcedefinitions", None)


def test_chart_operator_serves_the_sample_as_the_chart_service_account(installed, tmp_path):
    kubeconfig = installed.service_account_kubeconfig("iterserve", NAMESPACE)
    log = tmp_path / "operator.log"
    operator = OperatorProcess(kubeconfig, WATCHED, log).start()
    try:
        def served():
            found = installed.kubectl("-n", WATCHED, "get", "deployment,service,configmap,secret", "-o", "name").stdout
            status = installed.kubectl("-n", WATCHED, "get", "infsvc", "smollm2", "-o",
                                       "jsonpath={.status.observedGeneration}").stdout
            return all(kind in found for kind in ("deployment.apps/smollm2", "service/smollm2")) and status
        wait_for(served, 60, 0.5, f"the operator to serve the sample ({log})")
    finally:
        operator.stop()
    forbidden = [line for line in log.read_text().splitlines() if "403" in line or "Forbidden" in line]
    assert not forbidden, "the chart's RBAC denied the operator:\n" + "\n".join(forbidden)
