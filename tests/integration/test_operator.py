"""The real operator (a subprocess running as a ServiceAccount with exactly operator/rbac.py's
rules) against the real API server of the `k8s_cluster` fixture: the CRD and samples from the
repository, owned objects, drift repair, scale subresource, schema rejections, a crash."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from kubernetes import client

from iterserve.operator.kube import Kube
from iterserve.operator.models import GROUP, PLURAL, VERSION
from tests.operator_fixture import (
    OperatorProcess,
    ensure_node,
    example,
    install_crd,
    operator_namespace,
    wait_for,
)

pytestmark = pytest.mark.cluster
OWNED_KINDS = ("Deployment", "Service", "ConfigMap", "Secret")


@pytest.fixture(scope="module")
def env(k8s_cluster, tmp_path_factory):
    install_crd(k8s_cluster)
    ensure_node(k8s_cluster)
    namespace, kubeconfig = operator_namespace(k8s_cluster)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    operator = OperatorProcess(kubeconfig, namespace, log).start()
    api = k8s_cluster.api_client()
    yield Env(k8s_cluster, namespace, operator, api)
    operator.stop()
    forbidden = [line for line in log.read_text().splitlines() if "Forbidden" in line]
    assert not forbidden, "the operator hit RBAC denials; add the rule to operator/rbac.py:\n" + "\n".join(forbidden)
    api.close()


class Env:
    def __init__(self, cluster, namespace, operator, api):
        self.cluster, self.namespace, self.operator = cluster, namespace, operator
        self.kube = Kube(api)
        self.custom = client.CustomObjectsApi(api)

    def create(self, doc: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, doc)

    def patch_spec(self, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec},
                                                   _content_type="application/merge-patch+json")

    def get(self, name: str) -> dict | None:
        return self.kube.get_inference_service(self.namespace, name)

    def owned(self, kind: str, name: str) -> dict | None:
        object_name = {"ConfigMap": f"{name}-engine", "Secret": f"{name}-admin"}.get(kind, name)
        return self.kube.get(kind, self.namespace, object_name)

    def condition(self, name: str, type_: str) -> dict | None:
        body = self.get(name) or {}
        return next((c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == type_), None)

    def wait_ready(self, name: str, timeout: float = 60) -> dict:
        def ready():
            cond = self.condition(name, "Ready")
            return self.get(name) if cond and cond["status"] == "True" else None
        return wait_for(ready, timeout, what=lambda: f"{name} Ready=True (operator log:\n{self.operator.log_tail()})")

    def events(self, name: str) -> list[dict]:
        out = self.cluster.kubectl("-n", self.namespace, "get", "events", "-o", "json",
                                   "--field-selector", f"involvedObject.name={name},involvedObject.kind=InferenceService")
        return json.loads(out.stdout)["items"]

    def versions(self, name: str) -> dict[str, str]:
        found = {kind: self.owned(kind, name) for kind in OWNED_KINDS}
        found["InferenceService"] = self.get(name)
        return {kind: obj["metadata"]["resourceVersion"] for kind, obj in found.items()}


def minimal(name: str, **spec) -> dict:
    doc = example("minimal.yaml", **spec)
    doc["metadata"]["name"] = name
    return doc


def test_sample_becomes_owned_objects_with_status_and_events(env):
    env.create(minimal("basic"))
    body = env.wait_ready("basic")
    uid = body["metadata"]["uid"]
    for kind in OWNED_KINDS:
        obj = env.owned(kind, "basic")
        assert obj is not None, kind
        assert [(r["kind"], r["uid"], r["controller"]) for r in obj["metadata"]["ownerReferences"]] == [
            ("InferenceService", uid, True)], kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "iterserve-operator"
    container = env.owned("Deployment", "basic")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--model") + 1] == "smollm2-135m"
    assert "$(ITERSERVE_MAX_NUM_SEQS)" in container["args"]
    assert container["resources"]["requests"]["memory"] == "1Gi"
    assert env.owned("ConfigMap", "basic")["data"]["max_num_seqs"] == "16"
    assert {p["name"] for p in env.owned("Service", "basic")["spec"]["ports"]} == {"http", "metrics"}
    status = body["status"]
    assert status["readyReplicas"] == 1 and status["replicas"] == 1
    assert status["observedGeneration"] == body["metadata"]["generation"]
    assert status["selector"] == "app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance=basic"
    assert status["effectiveMaxNumSeqs"] == 16
    reasons = sorted(e["reason"] for e in env.events("basic"))
    # ConfigMap, NetworkPolicy, Service, Deployment, Secret, and the router's ServiceAccount, Role,
    # RoleBinding, Deployment, PodDisruptionBudget
    assert reasons.count("Created") == 10 and "Ready" in reasons
    assert env.owned("NetworkPolicy", "basic-engines") is not None
    printed = env.cluster.kubectl("-n", env.namespace, "get", "infsvc", "basic").stdout
    assert printed.split("\n")[0].split()[:7] == ["NAME", "MODEL", "REPLICAS", "READY", "WAITING", "KV", "AGE"]
    assert "smollm2-135m" in printed


def test_reconciling_an_unchanged_resource_changes_nothing(env):
    env.create(minimal("steady"))
    env.wait_ready("steady")
    before, events_before = env.versions("steady"), len(env.events("steady"))
    time.sleep(3 * env.operator.resync_seconds + 1)  # several timer reconciles
    assert env.versions("steady") == before
    assert len(env.events("steady")) == events_before
    assert 'iterserve_operator_reconciles_total{result="unchanged"}' in env.operator.metrics()


def test_spec_update_patches_objects_and_rolls_pods_only_when_it_must(env):
    env.create(minimal("rolling"))
    env.wait_ready("rolling")
    template = env.owned("Deployment", "rolling")["spec"]["template"]

    env.patch_spec("rolling", {"replicas": 2})
    wait_for(lambda: env.owned("Deployment", "rolling")["spec"]["replicas"] == 2, 20, what="replicas 2")
    assert env.owned("Deployment", "rolling")["spec"]["template"] == template  # no new pods for a scale

    env.patch_spec("rolling", {"engine": {"image": "ghcr.io/iterserve/engine:0.2.0"}})
    def image():
        return env.owned("Deployment", "rolling")["spec"]["template"]["spec"]["containers"][0]["image"]
    wait_for(lambda: image() == "ghcr.io/iterserve/engine:0.2.0", 20, what="the new image")
    assert any(e["reason"] == "Updated" and "image" in e["message"] for e in env.events("rolling"))
    wait_for(lambda: env.get("rolling")["status"]["observedGeneration"] == env.get("rolling")["metadata"]["generation"],
             20, what="observedGeneration to follow")


def test_kv_retune_changes_configmap_but_not_pods(env):
    doc = minimal("retuned", autoscaling={"mode": "Builtin", "kvRetune": {"floor": 4}})
    env.create(doc)
    env.wait_ready("retuned")
    template = env.owned("Deployment", "retuned")["spec"]["template"]
    # What the autoscaler does after lowering max_num_seqs on the engines: record it in status.
    env.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, env.namespace, PLURAL, "retuned", {"status": {"effectiveMaxNumSeqs": 12}},
        _content_type="application/merge-patch+json")
    wait_for(lambda: env.owned("ConfigMap", "retuned")["data"]["max_num_seqs"] == "12", 20,
             what="the ConfigMap to carry the tuned max_num_seqs")
    assert env.owned("Deployment", "retuned")["spec"]["template"] == template


def test_kubectl_scale_drives_the_deployment_through_the_scale_subresource(env):
    env.create(minimal("scaled", autoscaling={"mode": "External", "minReplicas": 1, "maxReplicas": 5}))
    env.wait_ready("scaled")
    env.cluster.kubectl("-n", env.namespace, "scale", "infsvc", "scaled", "--replicas=3")
    wait_for(lambda: env.owned("Deployment", "scaled")["spec"]["replicas"] == 3, 20, what="Deployment replicas 3")
    wait_for(lambda: (env.get("scaled")["status"].get("readyReplicas") == 3), 30, what="3 ready replicas in status")
    scale = json.loads(env.cluster.kubectl("-n", env.namespace, "get", "infsvc", "scaled",
                                           "--subresource=scale", "-o", "json").stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance=scaled"
    # External mode: the operator follows spec.replicas and never writes it back
    time.sleep(2 * env.operator.resync_seconds)
    assert env.get("scaled")["spec"]["replicas"] == 3
    managers = {m["manager"] for m in env.get("scaled")["metadata"]["managedFields"]
                if "f:replicas" in json.dumps(m.get("fieldsV1", {}).get("f:spec", {}))}
    assert "iterserve-operator" not in managers


def test_hand_deleted_service_is_recreated_and_edited_deployment_repaired(env):
    env.create(minimal("drifty"))
    env.wait_ready("drifty")
    old_uid = env.owned("Service", "drifty")["metadata"]["uid"]
    env.cluster.kubectl("-n", env.namespace, "delete", "service", "drifty")
    wait_for(lambda: (env.owned("Service", "drifty") or {}).get("metadata", {}).get("uid") not in (None, old_uid),
             20, what="the Service to be recreated")
    env.cluster.kubectl("-n", env.namespace, "set", "image", "deployment/drifty", "engine=example.com/other:1")
    def image():
        return env.owned("Deployment", "drifty")["spec"]["template"]["spec"]["containers"][0]["image"]
    wait_for(lambda: image() == "ghcr.io/iterserve/engine:0.1.0", 20, what="the image to be restored")
    env.cluster.kubectl("-n", env.namespace, "delete", "configmap", "drifty-engine")
    wait_for(lambda: env.owned("ConfigMap", "drifty"), 20, what="the ConfigMap to be recreated")


def test_schema_rejects_invalid_objects_naming_the_field(env):
    cases = [
        ({"autoscaling": {"minReplicas": 6, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
        ({"autoscaling": {"mode": "Sometimes"}}, "spec.autoscaling.mode"),
        ({"autoscaling": {"kvRetune": {"threshold": 1.5}}}, "spec.autoscaling.kvRetune.threshold"),
        ({"autoscaling": {"kvRetune": {"threshold": 0.7}}}, "spec.autoscaling.kvRetune.recoveryThreshold"),
        ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
        ({"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "spec.engine.maxNumSeqs"),
        ({"replicas": -1}, "spec.replicas"),
    ]
    for spec, field in cases:
        doc = minimal("rejected", **spec)
        result = env.cluster.kubectl("-n", env.namespace, "apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
        assert result.returncode != 0, f"{spec} was accepted"
        assert field in result.stderr, f"{spec}: {result.stderr}"
    doc = minimal("rejected")
    del doc["spec"]["model"]
    result = env.cluster.kubectl("-n", env.namespace, "apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0 and "spec.model" in result.stderr
    assert env.get("rejected") is None


def test_invalid_spec_past_the_schema_reports_instead_of_crashing(env):
    doc = minimal("confused")
    doc["spec"]["engine"]["extraArgs"] = ["--port", "9000"]
    env.create(doc)
    wait_for(lambda: (env.condition("confused", "InvalidSpec") or {}).get("status") == "True", 20,
             what="InvalidSpec=True")
    assert "spec.engine.extraArgs[0]" in env.condition("confused", "InvalidSpec")["message"]
    time.sleep(2 * env.operator.resync_seconds)
    assert all(env.owned(kind, "confused") is None for kind in OWNED_KINDS), "no partial objects"
    assert env.operator.alive()
    assert [e["type"] for e in env.events("confused") if e["reason"] == "InvalidSpec"] == ["Warning"]
    env.patch_spec("confused", {"engine": {"extraArgs": ["--seed", "3"]}})
    env.wait_ready("confused")
    assert env.condition("confused", "InvalidSpec")["status"] == "False"


def test_object_the_api_server_refuses_is_reported_and_nothing_is_half_applied(env):
    doc = minimal("refused", podTemplatePatch={"spec": {"restartPolicy": "Never"}})  # Deployments need Always
    env.create(doc)
    wait_for(lambda: (env.condition("refused", "InvalidSpec") or {}).get("status") == "True", 20,
             what="InvalidSpec=True")
    message = env.condition("refused", "InvalidSpec")["message"]
    assert "Deployment" in message and "restartPolicy" in message, message
    assert all(env.owned(kind, "refused") is None for kind in OWNED_KINDS), "nothing may be half applied"
    assert env.operator.alive()


def test_delete_removes_owned_objects(env):
    env.create(minimal("doomed"))
    env.wait_ready("doomed")
    env.cluster.kubectl("-n", env.namespace, "delete", "infsvc", "doomed", "--timeout=30s")
    wait_for(lambda: all(env.owned(kind, "doomed") is None for kind in OWNED_KINDS), 30,
             what="garbage collection of the owned objects")


@pytest.mark.slow
def test_operator_killed_mid_reconcile_converges_without_duplicates(k8s_cluster, tmp_path):
    install_crd(k8s_cluster)
    ensure_node(k8s_cluster)
    namespace, kubeconfig = operator_namespace(k8s_cluster, "crash")
    api = k8s_cluster.api_client()
    custom, core, apps = client.CustomObjectsApi(api), client.CoreV1Api(api), client.AppsV1Api(api)
    names = [f"svc{i}" for i in range(6)]
    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log").start()
    for name in names:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, minimal(name))

    def configmaps() -> int:
        return len(core.list_namespaced_config_map(namespace, label_selector="app.kubernetes.io/part-of=iterserve").items)
    wait_for(lambda: configmaps() >= 1, 60, 0.02, "the first owned object")
    operator.kill()
    deployments_at_kill = len(apps.list_namespaced_deployment(
        namespace, label_selector="app.kubernetes.io/name=iterserve-engine").items)
    tokens_at_kill = {s.metadata.name: s.data["token"] for s in core.list_namespaced_secret(
        namespace, label_selector="app.kubernetes.io/part-of=iterserve").items}
    print(f"\nkilled the operator with {configmaps()} ConfigMaps and {deployments_at_kill} Deployments "
          f"of {len(names)}")
    assert deployments_at_kill < len(names), "the kill came too late to interrupt the reconciles"

    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log").start()
    try:
        def converged():
            bodies = [custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, n) for n in names]
            return all(any(c["type"] == "Ready" and c["status"] == "True"
                           for c in (b.get("status") or {}).get("conditions", [])) for b in bodies)
        wait_for(converged, 90, 0.5, lambda: f"all to be Ready after the restart:\n{operator.log_tail()}")
    finally:
        operator.stop()
    selector = "app.kubernetes.io/part-of=iterserve"
    for listing in (apps.list_namespaced_deployment, core.list_namespaced_service,
                    core.list_namespaced_config_map, core.list_namespaced_secret):
        items = listing(namespace, label_selector=selector).items
        # one of each per InferenceService (Deployments: the engines' and the router's)
        per_service = 2 if listing == apps.list_namespaced_deployment else 1
        assert sorted(i.metadata.labels["app.kubernetes.io/instance"] for i in items) == sorted(names * per_service), \
            listing.__name__
    replica_sets = apps.list_namespaced_replica_set(namespace, label_selector=selector).items
    assert len(replica_sets) == len(names), "a restart must not roll the pods"
    secrets = {s.metadata.name: s.data["token"] for s in core.list_namespaced_secret(namespace, label_selector=selector).items}
    assert all(secrets[name] == token for name, token in tokens_at_kill.items()), "admin tokens must survive"
    api.close()


@pytest.mark.parametrize("sample", ["minimal.yaml", "gpu-autoscaling.yaml"])
def test_examples_and_what_they_build_pass_server_validation(env, sample):
    """Every sample, and the Deployment/Service/ConfigMap/Secret built from it, as the API server
    (not only the unit tests' idea of Kubernetes) validates them."""
    from iterserve.operator import resources
    from iterserve.operator.validation import parse_spec

    doc = example(sample)
    env.cluster.kubectl("-n", env.namespace, "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc))
    spec = parse_spec(doc["spec"])
    owner = resources.Owner(doc["metadata"]["name"], env.namespace, "00000000-0000-0000-0000-000000000000")
    built = [resources.build_deployment(owner, spec), resources.build_service(owner, spec),
             resources.build_configmap(owner, spec, spec.engine.max_num_seqs), resources.build_admin_secret(owner)]
    result = env.cluster.kubectl("-n", env.namespace, "create", "--dry-run=server", "-o", "json", "-f", "-",
                                 input=yaml.safe_dump_all(built))
    decoder, text, items = json.JSONDecoder(), result.stdout.strip(), []
    while text:  # kubectl prints one JSON document per object
        obj, end = decoder.raw_decode(text)
        items, text = items + [obj], text[end:].strip()
    assert [i["kind"] for i in items] == ["Deployment", "Service", "ConfigMap", "Secret"]
    pod = items[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": resources.PRESTOP_SLEEP_SECONDS}}


def test_gpu_service_lands_on_a_tainted_gpu_node(env):
    """The GPU request and the automatic nvidia.com/gpu toleration, as the real scheduler sees them."""
    node = f"gpu-tainted-{env.namespace}"
    env.cluster.add_gpu_node(node, gpus=2, labels={"pool": node},
                             taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    try:
        doc = minimal("gpu", replicas=2, scheduling={"nodeSelector": {"pool": node}})
        doc["spec"]["engine"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
        env.create(doc)
        env.wait_ready("gpu")
        pods = json.loads(env.cluster.kubectl("-n", env.namespace, "get", "pods", "-o", "json", "-l",
                                              "app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance=gpu"
                                              ).stdout)["items"]
        assert sorted(p["spec"]["nodeName"] for p in pods) == [node, node]
        assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1" for p in pods)
        # a third replica does not fit the node's 2 GPUs: Ready goes False and says why
        env.patch_spec("gpu", {"replicas": 3})
        wait_for(lambda: (env.condition("gpu", "Ready") or {}).get("status") == "False", 20, what="Ready=False")
        assert "2/3" in env.condition("gpu", "Ready")["message"]
    finally:
        env.cluster.kubectl("-n", env.namespace, "delete", "infsvc", "gpu", "--ignore-not-found", "--timeout=30s")
        env.cluster.kubectl("delete", "node", node, "--ignore-not-found")
