"""Safe to install in a shared cluster, against the real API server: an InferenceService
cannot weaken its pods' security (the chart's admission policy refuses it naming the field, and
so does the operator where the policy is absent), engine pods are admitted in a `restricted`
namespace, the operator never adopts an object it did not create, deletes finish with the
operator stopped, the autoscaler ignores look-alike pods (and never sends them the token), and a
deleted object's metric series go with it."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.hook import AutoscalerHook
from iterserve.operator.handlers import TickContext
from iterserve.operator.kube import FIELD_MANAGER, Kube
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import ENGINE_PORT, common_labels, selector_string
from tests import operator_fixture as fx
from tests.unit import test_operator_podsecurity as podsecurity_table
from tests.unit.chart_tools import CHART, helm

pytestmark = pytest.mark.cluster
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")

# One weakening patch per rule the issue names, and the field each message must name.
WEAKENING = {
    "privileged": ({"podTemplatePatch": {"spec": {"containers": [
        {"name": "engine", "securityContext": {"privileged": True}}]}}}, "securityContext.privileged"),
    "hostpath": ({"model": {"uri": "smollm2-135m", "volume": {"hostPath": {"path": "/"}}}}, "spec.model.volume.hostPath"),
    "hostnetwork": ({"podTemplatePatch": {"spec": {"hostNetwork": True}}}, "spec.podTemplatePatch.spec.hostNetwork"),
    "serviceaccount": ({"podTemplatePatch": {"spec": {"serviceAccountName": "default"}}},
                       "spec.podTemplatePatch.spec.serviceAccountName"),
}


def minimal(name: str, **spec) -> dict:
    doc = fx.example("minimal.yaml", **spec)
    doc["metadata"]["name"] = name
    return doc


class Env:
    def __init__(self, cluster, namespace: str, operator: fx.OperatorProcess, api):
        self.cluster, self.namespace, self.operator = cluster, namespace, operator
        self.kube = Kube(api)
        self.custom, self.core, self.apps = client.CustomObjectsApi(api), client.CoreV1Api(api), client.AppsV1Api(api)

    def create(self, doc: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, doc)

    def condition(self, name: str, type_: str) -> dict:
        body = self.kube.get_inference_service(self.namespace, name) or {}
        return next((c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == type_), {})

    def wait_condition(self, name: str, type_: str, status: str = "True", timeout: float = 30) -> dict:
        return fx.wait_for(lambda: self.condition(name, type_) if self.condition(name, type_).get("status") == status
                        else None, timeout, what=lambda: f"{name} {type_}={status} (log:\n{self.operator.log_tail()})")

    def events(self, name: str) -> list[dict]:
        out = self.cluster.kubectl("-n", self.namespace, "get", "events", "-o", "json", "--field-selector",
                                   f"involvedObject.name={name},involvedObject.kind=InferenceService")
        return json.loads(out.stdout)["items"]


@pytest.fixture(scope="module")
def env(k8s_cluster, tmp_path_factory):
    """The operator in a namespace that enforces the restricted Pod Security Standard."""
    fx.install_crd(k8s_cluster)
    fx.ensure_node(k8s_cluster)
    namespace, kubeconfig = fx.operator_namespace(k8s_cluster, prefix="iso")
    k8s_cluster.kubectl("label", "namespace", namespace, *RESTRICTED)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    operator = fx.OperatorProcess(kubeconfig, namespace, log).start()
    api = k8s_cluster.api_client()
    yield Env(k8s_cluster, namespace, operator, api)
    operator.stop()
    api.close()
    forbidden = [line for line in log.read_text().splitlines() if "Forbidden" in line]
    assert not forbidden, "\n".join(forbidden)


def test_weakening_patches_are_refused_by_the_api_server_naming_the_field(k8s_cluster):
    """The chart's ValidatingAdmissionPolicy, bound (namespaced mode) to one namespace."""
    fx.install_crd(k8s_cluster)
    namespace = f"vap-{int(time.time() * 1000) % 10**8}"
    k8s_cluster.kubectl("create", "namespace", namespace)
    rendered = yaml.safe_load_all(helm(
        "template", "vap", str(CHART), "--namespace", namespace, "--set", f"fullnameOverride={namespace}",
        "--set", "operator.watch.mode=namespaced", "--set", f"operator.watch.namespaces={{{namespace}}}",
        "--set", "admissionPolicy.runtimeClasses={nvidia}").stdout)
    policy_objects = [o for o in rendered if o and o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert len(policy_objects) == 2
    k8s_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(policy_objects))
    try:
        def apply(name: str, spec: dict):
            doc = minimal(name, **spec)
            doc["metadata"]["namespace"] = namespace
            # A server-side dry run: admission runs, nothing is stored, so a probe accepted before the
            # policy took effect cannot turn the later tries into no-op applies.
            return k8s_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)

        first_case, field = WEAKENING["privileged"]
        fx.wait_for(lambda: apply("probe", first_case).returncode != 0, 30, 0.5, "the admission policy to take effect")
        for case, (spec, field) in WEAKENING.items():
            result = apply(case, spec)
            assert result.returncode != 0, f"{case} was accepted"
            assert field in result.stderr and "restricted Pod Security profile" in result.stderr, result.stderr
        # Every row of the rules' unit table, through the generated CEL: the same refusals.
        for index, (rule, spec, _) in enumerate(podsecurity_table.REFUSED):
            result = apply(f"refused-{index}", spec)
            assert result.returncode != 0, f"{rule} case {spec} was accepted by the API server"
            assert f"allow: [{rule}]" in result.stderr, result.stderr
        assert apply("harmless", {"podTemplatePatch": {"metadata": {"labels": {"team": "a"}}}}).returncode == 0
        assert apply("allowed-class", {"podTemplatePatch": {"spec": {"runtimeClassName": "nvidia"}}}).returncode == 0
        for index, spec in enumerate(podsecurity_table.ACCEPTED):
            result = apply(f"accepted-{index}", spec)
            assert result.returncode == 0, result.stderr
    finally:
        for obj in policy_objects:
            k8s_cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found")
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_without_the_policy_the_operator_refuses_the_same_naming_the_field(env):
    for case, (spec, _) in WEAKENING.items():
        env.create(minimal(f"weak-{case}", **spec))
    for case, (_, field) in WEAKENING.items():
        condition = env.wait_condition(f"weak-{case}", "InvalidSpec")
        assert field in condition["message"] and "restricted Pod Security profile" in condition["message"], condition
    time.sleep(2 * env.operator.resync_seconds)
    deployments = env.apps.list_namespaced_deployment(env.namespace).items
    assert not [d.metadata.name for d in deployments if d.metadata.name.startswith("weak-")], "nothing built"


def test_engine_pods_with_a_patched_sidecar_are_admitted_in_a_restricted_namespace(env):
    env.create(minimal("restricted", podTemplatePatch={"spec": {"containers": [
        {"name": "log-shipper", "image": "busybox", "args": ["sleep", "infinity"]}]}}))
    env.wait_condition("restricted", "Ready", timeout=60)
    pods = env.core.list_namespaced_pod(env.namespace, label_selector=selector_string("restricted")).items
    assert len(pods) == 1 and [c.name for c in pods[0].spec.containers] == ["engine", "log-shipper"]


def _user_objects(name: str, namespace: str) -> dict[str, dict]:
    labels = {"app": "mine"}
    return {
        "Service": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
                    "spec": {"selector": labels, "ports": [{"port": 80}]}},
        "ConfigMap": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-engine", "labels": labels},
                      "data": {"max_num_seqs": "1", "mine": "yes"}},
        "Deployment": {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
                       "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                                "template": {"metadata": {"labels": labels},
                                             "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}},
        "Secret": {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-admin", "labels": labels},
                   "stringData": {"token": "the-users-own"}},
    }


def test_a_same_name_object_is_never_adopted_and_survives_the_delete(env):
    names_by_kind = {kind: f"taken-{kind.lower()}" for kind in ("Service", "ConfigMap", "Deployment", "Secret")}
    before = {}
    for kind, name in names_by_kind.items():
        obj = _user_objects(name, env.namespace)[kind]
        env.cluster.kubectl("-n", env.namespace, "apply", "-f", "-", input=yaml.safe_dump(obj))
        before[kind] = env.kube.get(kind, env.namespace, obj["metadata"]["name"])
        env.create(minimal(name))
    for kind, name in names_by_kind.items():
        condition = env.wait_condition(name, "Conflict")
        taken = before[kind]["metadata"]["name"]
        assert f"{kind} {env.namespace}/{taken}" in condition["message"], condition
        assert any(e["reason"] == "Conflict" and taken in e["message"] for e in env.events(name))
    time.sleep(2 * env.operator.resync_seconds)
    for kind, name in names_by_kind.items():
        now = env.kube.get(kind, env.namespace, before[kind]["metadata"]["name"])
        # The controller-manager writes a user Deployment's status after creation; only the spec, labels,
        # owners and field managers say whether the operator touched an object.
        assert now["metadata"].get("generation") == before[kind]["metadata"].get("generation"), f"{kind} touched"
        assert now["metadata"].get("labels") == before[kind]["metadata"].get("labels"), f"{kind} touched"
        assert now.get("data") == before[kind].get("data") and now.get("spec") == before[kind].get("spec"), kind
        managers = {m.get("manager") for m in now["metadata"].get("managedFields") or []}
        assert FIELD_MANAGER not in managers, f"{kind} written by the operator: {managers}"
        assert not now["metadata"].get("ownerReferences"), kind
        env.cluster.kubectl("-n", env.namespace, "delete", "infsvc", name, "--timeout=30s")
    time.sleep(3)  # the garbage collector's turn
    for kind in names_by_kind:
        assert env.kube.get(kind, env.namespace, before[kind]["metadata"]["name"]) is not None, f"{kind} deleted"


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#") and f'inferenceservice="{name}"' in line]


def test_series_of_a_deleted_object_are_gone(env):
    env.create(minimal("gauged", autoscaling={"mode": "Builtin", "intervalSeconds": 1, "warmupSeconds": 0}))
    fx.wait_for(lambda: any(names.AUTOSCALER_DESIRED_REPLICAS in line for line in _series(env.operator.metrics(), "gauged")),
             30, what="the autoscaler's series for gauged")
    env.cluster.kubectl("-n", env.namespace, "delete", "infsvc", "gauged", "--timeout=30s")
    fx.wait_for(lambda: not _series(env.operator.metrics(), "gauged"), 15,
             what=lambda: f"no series left for gauged:\n{_series(env.operator.metrics(), 'gauged')}")


class _LookAlike(BaseHTTPRequestHandler):
    """An 'engine' that reports a long queue and a full KV cache, and records what it is sent."""

    seen: list[tuple[str, str, str | None]] = []
    text = (f"{names.WAITING_REQUESTS} 100\n{names.RUNNING_SEQS} 16\n{names.KV_CACHE_USAGE} 0.99\n"
            f"{names.PREEMPTIONS_TOTAL} 5\n{names.MAX_NUM_SEQS} 16\n")

    def _answer(self, body: bytes) -> None:
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._answer(self.text.encode() if self.path.startswith("/metrics") else b'{"max_num_seqs": 16}')

    def do_PATCH(self):  # noqa: N802
        self._answer(b'{"max_num_seqs": 12}')

    def log_message(self, *args):
        pass


def test_a_look_alike_pod_neither_moves_replicas_nor_receives_the_token(k8s_cluster):
    fx.install_crd(k8s_cluster)
    fx.ensure_node(k8s_cluster)
    namespace, kubeconfig = fx.operator_namespace(k8s_cluster, prefix="alike")
    admin_api = k8s_cluster.api_client()
    custom, core = client.CustomObjectsApi(admin_api), client.CoreV1Api(admin_api)
    kube = Kube(k8s_cluster.api_client(kubeconfig))  # the operator's identity: rbac.RULES only
    reconciler, registry = Reconciler(kube), CollectorRegistry()
    hook = AutoscalerHook(metrics=OperatorMetrics(registry))
    name = "trusting"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, minimal(name, autoscaling={
        "mode": "Builtin", "minReplicas": 1, "maxReplicas": 3, "targetWaitingPerReplica": 2, "warmupSeconds": 0,
        "intervalSeconds": 1, "kvRetune": {"consecutiveSamples": 1}}))
    reconciler.reconcile(namespace, name)

    def ready_ips():
        pods = core.list_namespaced_pod(namespace, label_selector=selector_string(name)).items
        return {p.metadata.name: p.status.pod_ip for p in pods if p.status.pod_ip and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])}
    (own,) = fx.wait_for(ready_ips, 60, what="the engine pod Ready")
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "lookalike", "labels": common_labels(name)},
        "spec": {"nodeName": "operator-test-node", "containers": [{"name": "engine", "image": "busybox"}]}})
    ips = fx.wait_for(lambda: (lambda found: found if "lookalike" in found else None)(ready_ips()), 60,
                   what="the look-alike pod Ready with an address")
    with socket.socket() as probe:  # KWOK hands out the same addresses in every cluster
        if probe.connect_ex((ips["lookalike"], ENGINE_PORT)) == 0:
            raise RuntimeError(f"another process listens on {ips['lookalike']}:{ENGINE_PORT} (a concurrent run?)")
    _LookAlike.seen = []
    server = ThreadingHTTPServer((ips["lookalike"], ENGINE_PORT), _LookAlike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for _ in range(2):
            time.sleep(1.1)  # the hook acts at most every intervalSeconds
            outcome = reconciler.reconcile(namespace, name)
            hook(TickContext(namespace, name, outcome.body, outcome.spec, reconciler, kube, logging.getLogger("test")))
        body = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    finally:
        server.shutdown()
        server.server_close()
        admin_api.close()
    assert body["spec"]["replicas"] == 1, "the look-alike's queue moved the replica count"
    assert [p["name"] for p in body["status"]["pods"]] == [own]
    assert _LookAlike.seen == [], f"the autoscaler talked to the look-alike: {_LookAlike.seen}"
    text = generate_latest(registry).decode()
    assert f'{names.AUTOSCALER_UNTRUSTED_PODS}{{inferenceservice="{name}",namespace="{namespace}"}} 1.0' in text


def test_deletes_complete_with_the_operator_stopped(env):
    """Last in this module: it stops the module's operator and deletes its namespace."""
    env.create(minimal("doomed"))
    env.wait_condition("doomed", "Ready", timeout=60)
    env.operator.stop()
    started = time.monotonic()
    env.cluster.kubectl("-n", env.namespace, "delete", "infsvc", "doomed", "--timeout=60s", timeout=70)
    env.cluster.kubectl("delete", "namespace", env.namespace, "--timeout=60s", timeout=70)
    elapsed = time.monotonic() - started
    print(f"\nInferenceService and namespace deleted in {elapsed:.1f} s with the operator stopped")
    assert elapsed < 60


def test_a_pod_with_a_forged_owner_reference_gets_no_traffic_and_no_token(k8s_cluster):
    """Labels, the ReplicaSet's UID as controller and its pod-template-hash are all copied onto a
    hand-made pod. Before the controller-chain check the autoscaler trusted exactly these two
    facts, so the forgery passed as one of the Deployment's pods; now the router's discovery and
    the autoscaler both refuse it, read from the real API server (it runs another image)."""
    from iterserve import controller_chain
    from iterserve.operator.autoscaling.loop import trusted_pods
    from iterserve.router.discovery import ChainReader

    fx.install_crd(k8s_cluster)
    fx.ensure_node(k8s_cluster)
    namespace, kubeconfig = fx.operator_namespace(k8s_cluster, prefix="forge")
    admin_api = k8s_cluster.api_client()
    custom, core = client.CustomObjectsApi(admin_api), client.CoreV1Api(admin_api)
    kube = Kube(k8s_cluster.api_client(kubeconfig))
    name = "forged"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, minimal(name))
    Reconciler(kube).reconcile(namespace, name)
    real = fx.wait_for(lambda: next((p for p in kube.list_pods(namespace, selector_string(name))
                                     if controller_chain.controller(p)), None), 60, what="the engine pod")
    try:
        for attempt in range(5):  # the ReplicaSet controller may delete the extra pod it now counts
            core.create_namespaced_pod(namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"forgery-{attempt}", "labels": real["metadata"]["labels"],
                             "ownerReferences": real["metadata"]["ownerReferences"]},
                "spec": {"nodeName": "operator-test-node", "containers": [{"name": "engine", "image": "busybox"}]}})
            pods = kube.list_pods(namespace, selector_string(name))
            if any(p["metadata"]["name"] == f"forgery-{attempt}" for p in pods):
                break
        else:
            pytest.fail("the forged pod never stayed long enough to be listed")
        forged = f"forgery-{attempt}"
        replica_sets = kube.list_replica_sets(namespace, selector_string(name))
        deployment = kube.get("Deployment", namespace, name)
        # the router's check, as its discovery runs it (reading the chain from the API server)
        routed = ChainReader(admin_api, namespace, name, selector_string(name)).verified(pods)
        assert [p["metadata"]["name"] for p in routed] == [real["metadata"]["name"]]
        _, refused = controller_chain.verify(pods, [deployment], replica_sets)
        assert [(r.pod, r.reason) for r in refused] == [(forged, controller_chain.SPEC_MISMATCH)]
        # the autoscaler's: never read, never sent the admin token
        trusted, strangers = trusted_pods(pods, deployment, replica_sets)
        assert [p["metadata"]["name"] for p in trusted] == [real["metadata"]["name"]] and strangers == [forged]
    finally:
        admin_api.close()


def test_the_network_policy_is_stored_by_the_api_server_and_removed_when_turned_off(k8s_cluster):
    """Applied for real with the operator's own rights (rbac.RULES). The local pod runtime does
    not enforce NetworkPolicy, so what is checked is the object the API server accepted."""
    from iterserve.operator import network_policy

    fx.install_crd(k8s_cluster)
    namespace, kubeconfig = fx.operator_namespace(k8s_cluster, prefix="netpol")
    kube = Kube(k8s_cluster.api_client(kubeconfig))
    custom = client.CustomObjectsApi(k8s_cluster.api_client())
    name = "walled"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, minimal(
        name, disaggregation={"enabled": True, "kvTransferPort": 8100}))
    peer = network_policy.parse_peer('{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": '
                                     '"monitoring"}}, "podSelector": {"matchLabels": {"app": "prometheus"}}}')
    on = network_policy.NetworkPolicySettings(True, (peer,))
    Reconciler(kube, network=on).reconcile(namespace, name)
    stored = kube.get("NetworkPolicy", namespace, network_policy.policy_name(name))
    assert stored is not None and stored["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    http, kv = stored["spec"]["ingress"]
    assert http["from"][1] == peer and http["ports"] == [{"protocol": "TCP", "port": ENGINE_PORT}]
    assert kv["ports"] == [{"protocol": "TCP", "port": 8100}]
    # the KV port is open to the service's decode pods only: they are the pool that pulls
    decode = {**stored["spec"]["podSelector"]["matchLabels"], network_policy.ROLE_LABEL: network_policy.DECODE}
    assert kv["from"] == [{"podSelector": {"matchLabels": decode}}]
    Reconciler(kube, network=network_policy.NetworkPolicySettings(enabled=False)).reconcile(namespace, name)
    assert kube.get("NetworkPolicy", namespace, network_policy.policy_name(name)) is None
