"""`helm install` of charts/iterserve into the test control plane, in both watch modes: the API
server accepts every object (CRD, RBAC, Deployment, the sample InferenceService), the operator's
ServiceAccount can make exactly the calls in operator/rbac.py where it watches and nowhere else,
and the real operator running as that ServiceAccount serves the chart's sample."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from iterserve.operator import rbac
from tests.operator_fixture import REPO, free_port, wait_for
from tests.unit.chart_tools import CHART, helm

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "iterserve"
NAMESPACE = "iterserve-system"


@dataclass
class Install:
    cluster: object
    mode: str
    sample_namespace: str  # where the chart put its sample InferenceService
    other_namespace: str  # a namespace the operator does not watch in namespaced mode


def can(api, verb: str, group: str, resource: str, namespace: str | None) -> bool:
    from kubernetes import client

    name, _, subresource = resource.partition("/")
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, group=group, resource=name, subresource=subresource or None, namespace=namespace)))
    return client.AuthorizationV1Api(api).create_self_subject_access_review(review).status.allowed


@pytest.fixture(scope="module", params=["namespaced", "cluster"])
def installed(request, k8s_cluster):
    mode = request.param
    watched, other = f"chart-{mode}-a", f"chart-{mode}-b"
    for namespace in (watched, other):
        k8s_cluster.kubectl("create", "namespace", namespace)
    sets = ["--set", "sample.enabled=true"]
    if mode == "namespaced":
        sets += ["--set", "operator.watch.mode=namespaced", "--set", f"operator.watch.namespaces={{{watched}}}"]
    kubeconfig = str(k8s_cluster.kubeconfig)
    helm("install", RELEASE, str(CHART), "--kubeconfig", kubeconfig, "--namespace", NAMESPACE,
         "--create-namespace", *sets)
    yield Install(k8s_cluster, mode, watched if mode == "namespaced" else NAMESPACE, other)
    helm("uninstall", RELEASE, "--kubeconfig", kubeconfig, "--namespace", NAMESPACE)
    for namespace in (watched, other):
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_chart_installs_crd_operator_and_sample(installed):
    cluster = installed.cluster
    crd = cluster.kubectl("get", "crd", "inferenceservices.iterserve.dev", "-o",
                          "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
    assert crd == "True"
    cluster.kubectl("-n", NAMESPACE, "get", "deployment/iterserve", "serviceaccount/iterserve")
    sample = cluster.kubectl("-n", installed.sample_namespace, "get", "infsvc", "smollm2", "-o",
                             "jsonpath={.spec.autoscaling.maxReplicas}").stdout
    assert sample == "3"
    status = helm("status", RELEASE, "--kubeconfig", str(cluster.kubeconfig), "--namespace", NAMESPACE).stdout
    assert "STATUS: deployed" in status and "Create your first InferenceService" in status


def test_chart_service_account_has_exactly_the_operator_permissions(installed):
    cluster = installed.cluster
    kubeconfig = cluster.service_account_kubeconfig("iterserve", NAMESPACE)
    watched = installed.sample_namespace
    with cluster.api_client(kubeconfig) as api:
        for group, resource, verb in sorted(rbac.permissions()):
            assert can(api, verb, group, resource, watched), f"cannot {verb} {group}/{resource} in {watched}"
            elsewhere = can(api, verb, group, resource, installed.other_namespace)
            assert elsewhere == (installed.mode == "cluster"), f"{verb} {group}/{resource} in another namespace"
        # The router's Role is created by the operator, so it holds roles create and deployments delete
        # (rbac.py); escalating or binding roles beyond its own rights, and secrets, stay out of reach.
        never = [("", "secrets", "list"), ("", "secrets", "delete"), ("apps", "deployments", "deletecollection"),
                 ("", "pods/exec", "create"), ("rbac.authorization.k8s.io", "roles", "escalate"),
                 ("rbac.authorization.k8s.io", "roles", "bind"), ("rbac.authorization.k8s.io", "clusterroles", "create")]
        assert not set(never) & set(rbac.permissions())
        for group, resource, verb in never:
            assert not can(api, verb, group, resource, watched), f"may {verb} {group}/{resource}"
        assert not can(api, "list", "", "nodes", None)
        assert not can(api, "create", "apiextensions.k8s.io", "customresourcedefinitions", None)


def test_chart_operator_serves_the_sample_as_the_chart_service_account(installed, tmp_path):
    cluster = installed.cluster
    kubeconfig = cluster.service_account_kubeconfig("iterserve", NAMESPACE)
    scope = ["-n", installed.sample_namespace] if installed.mode == "namespaced" else ["--all-namespaces"]
    liveness = free_port()
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "iterserve.cli", "operator", "run", *scope, "--kubeconfig", str(kubeconfig),
             "--liveness", f"http://127.0.0.1:{liveness}/healthz", "--metrics-port", "0", "--resync-seconds", "2"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        def served():
            assert operator.poll() is None, f"the operator exited:\n{log.read_text()}"
            ns = installed.sample_namespace
            found = cluster.kubectl("-n", ns, "get", "deployment,service", "-o", "name").stdout
            status = cluster.kubectl("-n", ns, "get", "infsvc", "smollm2", "-o",
                                     "jsonpath={.status.observedGeneration}").stdout
            return "deployment.apps/smollm2" in found and "service/smollm2" in found and status
        wait_for(served, 60, 0.5, f"the operator to serve the sample ({log})")
    finally:
        operator.terminate()
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(5)
    # The message after the timestamp: a time like "14:32:05,403" is not a 403.
    forbidden = [line for line in log.read_text().splitlines()
                 if re.search(r"\b403\b|Forbidden", line.split(" ", 2)[-1])]
    assert not forbidden, "the chart's RBAC denied the operator:\n" + "\n".join(forbidden)
