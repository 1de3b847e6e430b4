"""Multi-node replica groups on the real control plane (operator/groups.py): the StatefulSet
groups, their headless Service and the LeaderWorkerSet (its CRD pinned beside this file) are
accepted by the API server, server-side dry run and real; and an InferenceService whose replica
spans three pods runs on three KWOK nodes through the local pod runtime: the members rendezvous by
the leader's DNS name, the router serves a chat completion from the leader, a second group comes
and goes with spec.replicas, and killing a worker restarts its whole group."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from iterserve.devcluster.waiting import wait_for
from iterserve.operator import groups
from iterserve.operator.kube import Kube
from iterserve.operator.validation import parse_spec

pytestmark = pytest.mark.cluster
LWS_CRD = Path(os.environ.get("ITERSERVE_LWS_CRD", Path(__file__).with_name("leaderworkerset_crd_v0.8.0.yaml")))
SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 2, "engine": {"parallelism": {"tensor": 2, "nodes": 2}}}


@pytest.fixture
def namespace(k8s_cluster):
    name = f"g-{uuid.uuid4().hex[:8]}"
    k8s_cluster.kubectl("create", "namespace", name)
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _apply(cluster, obj: dict, namespace: str, *extra: str, check: bool = True):
    return cluster.kubectl("apply", "--server-side", "-n", namespace, *extra, "-f", "-", input=json.dumps(obj),
                           check=check)


def _unowned(obj: dict) -> dict:
    obj = json.loads(json.dumps(obj))
    obj["metadata"].pop("ownerReferences")  # no InferenceService object in these tests
    return obj


def test_statefulset_groups_and_their_headless_service_are_accepted(k8s_cluster, namespace):
    owner = groups.Owner("chat", namespace, "uid-1")
    service, first, second = (_unowned(o) for o in groups.build_groups(owner, parse_spec(SPEC), lws=False))
    for obj in (service, first, second):
        _apply(k8s_cluster, obj, namespace, "--dry-run=server")
        _apply(k8s_cluster, obj, namespace)
    stored = json.loads(k8s_cluster.kubectl("get", "statefulset", "chat-g1", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["serviceName"] == "chat-group" and stored["spec"]["replicas"] == 2
    headless = json.loads(k8s_cluster.kubectl("get", "service", "chat-group", "-n", namespace, "-o", "json").stdout)
    assert headless["spec"]["clusterIP"] == "None"


@pytest.fixture
def lws_crd(k8s_cluster):
    """The LeaderWorkerSet CRD, installed for one test only: while the API server serves it, the
    operator renders every group as a LeaderWorkerSet, which nothing runs on this cluster."""
    crd = yaml.safe_load(LWS_CRD.read_text())
    k8s_cluster.kubectl("apply", "-f", str(LWS_CRD))
    yield crd
    k8s_cluster.kubectl("delete", "crd", crd["metadata"]["name"], "--wait=true", "--timeout=60s", check=False)
    wait_for(lambda: k8s_cluster.kubectl("get", "leaderworkersets", "-A", check=False).returncode != 0,
             what="leaderworkersets gone from discovery")


def test_the_leaderworkerset_is_accepted_with_its_crd_installed(k8s_cluster, namespace, lws_crd):
    crd = lws_crd
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=30s")
    wait_for(lambda: k8s_cluster.kubectl("get", "leaderworkersets", "-A", check=False).returncode == 0,
             what="leaderworkersets discovery")
    owner = groups.Owner("chat", namespace, "uid-1")
    (lws,) = (_unowned(o) for o in groups.build_groups(owner, parse_spec(SPEC), lws=True))
    _apply(k8s_cluster, lws, namespace, "--dry-run=server")
    api = k8s_cluster.api_client()
    try:  # the operator's own calls: discovery, server-side apply (dry run, then real), read back
        kube = Kube(api)
        assert kube.api_resource_served(groups.LWS_GROUP, groups.LWS_VERSION, groups.LWS_PLURAL)
        kube.apply(lws, dry_run=True)
        assert kube.get(groups.LEADER_WORKER_SET, namespace, "chat") is None
        kube.apply(lws)
        assert kube.get(groups.LEADER_WORKER_SET, namespace, "chat")["spec"]["replicas"] == 2
    finally:
        api.close()
    stored = json.loads(k8s_cluster.kubectl("get", "leaderworkerset", "chat", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["replicas"] == 2 and stored["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert stored["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert stored["spec"]["rolloutStrategy"]["type"] == "RollingUpdate"  # the CRD's defaults applied
    worker = stored["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert "http" not in [p["name"] for p in worker["ports"]]
    scaled = k8s_cluster.kubectl("scale", "leaderworkerset", "chat", "-n", namespace, "--replicas=3")
    assert scaled.returncode == 0  # its scale subresource counts groups
    bad = json.loads(json.dumps(lws))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    refused = _apply(k8s_cluster, bad, namespace, check=False)
    assert refused.returncode != 0 and "restartPolicy" in refused.stderr


# ------------------------------------------------------------ a group on the local pod runtime


@pytest.fixture
def operated(k8s_cluster, tmp_path):
    """Three local-runtime nodes, a namespace with the operator (exactly rbac.RULES) and the pod runtime."""
    from tests import operator_fixture as fx

    with fx.operated_namespace(k8s_cluster, tmp_path, prefix="grp", nodes=3) as (namespace, operator, api, runner, nodes):
        yield namespace, operator, api, runner, nodes, tmp_path


def group_service(name: str) -> dict:
    """The embedded model at tensor-parallel size 3 over three pods, one rank each (SmolLM2's 9
    heads and 3 KV heads split over 3, not 2; there is no smaller model a pod may name here); the
    operator puts each member on its own node."""
    from iterserve.devcluster.podrunner import local_runtime_scheduling

    return {"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"uri": "smollm2-135m"}, "replicas": 1,
                     "engine": {"parallelism": {"tensor": 3, "nodes": 3}, "maxNumSeqs": 4, "maxModelLen": 256,
                                "kvCacheMemory": "16MiB", "startupSeconds": 300, "drainSeconds": 2,
                                # one dtype on every node (auto measures bf16's speed on each)
                                "extraArgs": ["--dtype", "float32"]},
                     "scheduling": local_runtime_scheduling(),
                     "podTemplatePatch": {"spec": {"containers": [{
                         "name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 300},
                         "readinessProbe": {"periodSeconds": 1}}]}}}}


@pytest.mark.slow
def test_a_multi_node_group_serves_scales_by_groups_and_restarts_as_a_group(k8s_cluster, operated):
    from kubernetes import client

    from iterserve.labels import is_leader
    from iterserve.operator.kube import Kube
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.operator.resources import selector_string
    from iterserve.operator.routing import router_labels
    from iterserve.router.discovery import ready_urls
    from tests.operator_fixture import wait_for as wait

    namespace, operator, api, runner, nodes, tmp = operated
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    assert not kube.api_resource_served(groups.LWS_GROUP, groups.LWS_VERSION, groups.LWS_PLURAL)  # StatefulSets
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, group_service("big"))

    def members(group: str) -> list[dict]:
        return [p for p in kube.list_pods(namespace, f"{groups.GROUP_LABEL}={group}")
                if not p["metadata"].get("deletionTimestamp")]

    def status() -> dict:
        return (kube.get_inference_service(namespace, "big") or {}).get("status") or {}

    def ready_groups(count: int):
        return lambda: status().get("readyReplicas") == count and status().get("replicas") == count

    wait(ready_groups(1), 420, 1, lambda: f"one ready group; operator:\n{operator.log_tail()}\npods: {tmp / 'pods'}")
    pods = members("big-g0")
    assert sorted(p["metadata"]["name"] for p in pods) == ["big-g0-0", "big-g0-1", "big-g0-2"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 3  # one member per node
    assert [p["metadata"]["name"] for p in pods if is_leader(p)] == ["big-g0-0"]

    router = wait(lambda: ready_urls(kube.list_pods(namespace, ",".join(
        f"{k}={v}" for k, v in router_labels("big").items())), "http"), 60, 0.5, "a ready router pod")[0]
    leaders = ready_urls(kube.list_pods(namespace, selector_string("big")), "http")
    assert len(leaders) == 1 and leaders[0].startswith(f"http://{pods[0]['status']['podIP']}")
    reply = wait(lambda: _chat(router), 60, 1, "a chat completion through the router")
    assert reply["choices"][0]["message"]["content"]

    # a second group comes with spec.replicas and goes again, whole
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "big", {"spec": {"replicas": 2}})
    wait(ready_groups(2), 420, 1, lambda: f"two ready groups; operator:\n{operator.log_tail()}")
    assert len(members("big-g1")) == 3
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "big", {"spec": {"replicas": 1}})
    wait(lambda: kube.get("StatefulSet", namespace, "big-g1") is None and ready_groups(1)(), 120, 1,
         lambda: f"back to one group; operator:\n{operator.log_tail()}")

    # a worker killed: the whole group restarts and serves again
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in members("big-g0")}
    worker = runner.worker_for(namespace, "big-g0-1")
    assert worker is not None and worker.process is not None
    os.kill(worker.process.pid, signal.SIGKILL)
    wait(lambda: {p["metadata"]["name"]: p["metadata"]["uid"] for p in members("big-g0")}.keys() == before.keys()
         and all(p["metadata"]["uid"] != before[p["metadata"]["name"]] for p in members("big-g0")), 120, 1,
         lambda: f"both members recreated; operator:\n{operator.log_tail()}")
    wait(ready_groups(1), 420, 1, lambda: f"the group ready again; operator:\n{operator.log_tail()}")
    assert wait(lambda: _chat(router), 60, 1, "a chat completion after the restart")["choices"]


def _chat(router: str) -> dict | None:
    try:
        response = httpx.post(f"{router}/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None
