"""Prefill/decode disaggregation with multi-node groups on the real control plane: the operator
runs a prefill group and a decode group of three pods each on three local-runtime nodes (one
rank per pod: the embedded model's 9 heads split over 3; it is the only model a pod may name, and
no even split of it exists, so the groups span three nodes rather than two), and a chat
completion through the router is prefilled on the prefill group, every decode rank pulling its
KV shard from the prefill rank of its index on another node."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine import metrics as names
from iterserve.labels import DECODE, PREFILL, ROLE_LABEL, is_leader
from iterserve.operator import groups

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]  # six engine processes load the model
NAME = "pdg"


@pytest.fixture
def operated(k8s_cluster, tmp_path):
    from tests import operator_fixture as fx

    with fx.operated_namespace(k8s_cluster, tmp_path, prefix="pdg", nodes=3) as (namespace, operator, api, runner, _):
        yield namespace, operator, api, runner, tmp_path


def disaggregated_groups(name: str) -> dict:
    from iterserve.devcluster.podrunner import local_runtime_scheduling

    return {"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"uri": "smollm2-135m"}, "replicas": 1,
                     "engine": {"parallelism": {"tensor": 3, "nodes": 3}, "maxNumSeqs": 4, "maxModelLen": 256,
                                "kvCacheMemory": "16MiB", "startupSeconds": 300, "drainSeconds": 2,
                                "extraArgs": ["--dtype", "float32"]},  # one dtype on every node
                     "disaggregation": {"enabled": True, "thresholdTokens": 8,
                                        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 1}},
                     "scheduling": local_runtime_scheduling(),
                     "podTemplatePatch": {"spec": {"containers": [{
                         "name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 300},
                         "readinessProbe": {"periodSeconds": 1}}]}}}}


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_prefill_group_and_a_decode_group_serve_a_chat_completion_through_the_router(k8s_cluster, operated):
    from kubernetes import client

    from iterserve.operator.kube import Kube
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.operator.resources import selector_string
    from iterserve.operator.routing import router_labels
    from iterserve.router.discovery import ready_urls
    from tests.operator_fixture import wait_for as wait

    namespace, operator, api, runner, tmp = operated
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, disaggregated_groups(NAME))

    def status() -> dict:
        return (kube.get_inference_service(namespace, NAME) or {}).get("status") or {}

    def both_pools_ready() -> bool:
        return status().get("readyReplicas") == 1 and (status().get("prefill") or {}).get("readyReplicas") == 1

    wait(both_pools_ready, 600, 1, lambda: f"both pools' groups ready; status {status()}\noperator:\n"
                                           f"{operator.log_tail()}\npods: {tmp / 'pods'}")
    assert kube.get("Deployment", namespace, f"{NAME}-prefill") is None  # the prefill pool is groups
    pods = [p for p in kube.list_pods(namespace, selector_string(NAME)) if not p["metadata"].get("deletionTimestamp")]
    by_group: dict[str, list[dict]] = {}
    for pod in pods:
        by_group.setdefault(pod["metadata"]["labels"][groups.GROUP_LABEL], []).append(pod)
    assert sorted(by_group) == [f"{NAME}-g0", f"{NAME}-prefill-g0"]
    for group, members in by_group.items():
        role = PREFILL if "prefill" in group else DECODE
        assert len(members) == 3 and {p["metadata"]["labels"][ROLE_LABEL] for p in members} == {role}
        assert len({p["spec"]["nodeName"] for p in members}) == 3  # one member per node
        assert [p["metadata"]["name"] for p in members if is_leader(p)] == [f"{group}-0"]

    router = wait(lambda: ready_urls(kube.list_pods(namespace, ",".join(
        f"{k}={v}" for k, v in router_labels(NAME).items())), "http"), 60, 0.5, "a ready router pod")[0]
    prefill_leader = next(p for p in by_group[f"{NAME}-prefill-g0"] if is_leader(p))["status"]["podIP"]
    wait(lambda: prefill_leader in httpx.get(f"{router}/metrics", timeout=5).text, 60, 0.5,
         "the router to see the prefill group's leader")

    prompt = " ".join(f"word{i}" for i in range(48))  # well over thresholdTokens
    response = httpx.post(f"{router}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert _metric(router, names.ROUTER_PD_DECISIONS_TOTAL, reason="remote") >= 1
    decode_leader = next(p for p in by_group[f"{NAME}-g0"] if is_leader(p))
    decode_url = f"http://{decode_leader['status']['podIP']}:8000"
    # one pull per request, finished only once every rank of the decode group held its shard
    assert _metric(decode_url, names.KV_TRANSFER_SECONDS + "_count") >= 1
    assert _metric(decode_url, names.KV_TRANSFER_FAILURES_TOTAL) == 0


def test_both_pools_groups_and_the_network_policy_are_accepted_by_the_api_server(k8s_cluster):
    """Server-side dry runs of what the operator writes for TP=2 x PP=2 over nodes 2 (no pod runs):
    both pools' StatefulSets (every member declaring the four KV ports), the headless Service, and
    the NetworkPolicy's port ranges (endPort) around the KV range."""
    import json
    import uuid

    from iterserve.operator import network_policy
    from iterserve.operator.resources import Owner
    from iterserve.operator.validation import parse_spec

    namespace = f"pdg-{uuid.uuid4().hex[:6]}"
    k8s_cluster.kubectl("create", "namespace", namespace)
    try:
        owner = Owner("chat", namespace, "uid-1")
        spec = parse_spec({"model": {"uri": "smollm2-135m"}, "replicas": 2,
                           "engine": {"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 2}},
                           "disaggregation": {"enabled": True, "prefill": {"replicas": 1}}})
        objects = [*groups.build_groups(owner, spec, lws=False),
                   *network_policy.build_for(owner, spec, network_policy.DEFAULT_SETTINGS)]
        assert [o["metadata"]["name"] for o in objects] == ["chat-group", "chat-g0", "chat-g1", "chat-prefill-g0",
                                                           "chat-engines"]
        for obj in objects:
            obj = json.loads(json.dumps(obj))
            obj["metadata"].pop("ownerReferences")  # no InferenceService object here
            k8s_cluster.kubectl("apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-",
                                input=json.dumps(obj))
    finally:
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
