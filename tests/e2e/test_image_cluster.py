"""The Helm chart with the built image, end to end, on the local cluster in container mode: every
pod (the operator, the router, the engines) is `podman run` of the image (the pod runtime's
container mode, docs/image.md), not a local process.

`helm install` of charts/iterserve with the image (operator pod); an InferenceService with two
engine replicas of the embedded model behind the router pods; a chat completion through the
InferenceService's Service; with minReplicas lowered to one, the autoscaler scales down while idle
and back up to two under load; then the InferenceService is deleted and `helm uninstall` leaves no pod, no
container and no iterserve object behind. The image is built once per machine and reused by its
content hash (tests/image_fixture.py); without podman or runc the test skips and says why."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid

import httpx
import pytest

from e2e.wholeloop.endpoints import ReadyEndpoints
from iterserve.devcluster import podman
from iterserve.devcluster.podrunner import (
    PodRunner,
    add_local_runtime_node,
    local_runtime_scheduling,
)
from iterserve.devcluster.podrunner.container import CONTAINER_LABEL, POD_LABEL
from iterserve.engine.config import DEFAULT_MODEL
from iterserve.engine.loadgen import LoadSpec, run_load
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.routing import router_labels
from tests.image_fixture import FIRST_BUILD_TIMEOUT_S, built_image
from tests.operator_fixture import wait_for
from tests.unit.chart_tools import CHART, helm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.cluster, pytest.mark.image,
              pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S)]

RELEASE = "iterserve-img"  # contains the chart's name: objects are named after the release
NAME = "chat"
ENGINE_MEMORY = "3Gi"  # -> podman run --memory
ENGINE_SELECTOR = "app.kubernetes.io/name=iterserve-engine"
START_TIMEOUT_S = 300  # containers start on a shared two-core machine
NAMESPACED_KINDS = ("deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,roles,rolebindings,"
                    "networkpolicies,poddisruptionbudgets,inferenceservices")
NAMESPACE_DEFAULTS = ("serviceaccount/default", "configmap/kube-root-ca.crt")


def inference_service(image: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": DEFAULT_MODEL},
            "engine": {
                "image": image,
                "maxNumSeqs": 2, "maxModelLen": 256, "kvCacheMemory": "16MiB", "drainSeconds": 20,
                "startupSeconds": 240,
                "resources": {"limits": {"nvidia.com/gpu": 1, "memory": ENGINE_MEMORY}},
            },
            "replicas": 2,
            # Two replicas until the test lowers minReplicas; then the autoscaler scales 2 -> 1 -> 2.
            "autoscaling": {
                "mode": "Builtin", "minReplicas": 2, "maxReplicas": 2, "targetWaitingPerReplica": 2,
                "intervalSeconds": 1, "warmupSeconds": 2, "coldStartSeconds": 240,
                "scaleDown": {"stabilizationWindowSeconds": 8},
            },
            "scheduling": local_runtime_scheduling(),
            "routing": {"mode": "Router", "maxQueue": 100, "queueTimeoutSeconds": 120},
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine",
                "startupProbe": {"periodSeconds": 2, "failureThreshold": 120},
                "readinessProbe": {"periodSeconds": 1},
            }]}},
        },
    }


def containers(runner_id: str) -> dict[str, dict]:
    """This runner's containers by pod (namespace/name), as `podman inspect` shows them."""
    listed = subprocess.run(["podman", "ps", "-a", "--filter", f"label={CONTAINER_LABEL}={runner_id}",
                             "--format", "{{.Names}}"], capture_output=True, text=True, env=podman.podman_env(),
                            timeout=60, check=True).stdout.split()
    if not listed:
        return {}
    inspected = subprocess.run(["podman", "inspect", *listed], capture_output=True, text=True,
                               env=podman.podman_env(), timeout=60)
    return {c["Config"]["Labels"][POD_LABEL]: c for c in json.loads(inspected.stdout or "[]")}


class Cluster:
    def __init__(self, k8s_cluster):
        from kubernetes import client

        self.k8s = k8s_cluster
        self.api = k8s_cluster.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        return json.loads(self.core.list_namespaced_pod(namespace, label_selector=selector,
                                                        _preload_content=False).data)["items"]

    def infsvc(self, namespace: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)


def states(cluster: Cluster, *namespaces: str) -> str:
    """Each pod's phase and waiting reason, for a timeout's message."""
    out = []
    for ns in namespaces:
        for pod in cluster.pods(ns):
            status = pod.get("status") or {}
            waiting = [(c.get("state") or {}).get("waiting") or {} for c in status.get("containerStatuses") or []]
            out.append(f"{pod['metadata']['name']} {status.get('phase')} "
                       + " ".join(f"{w.get('reason')}: {w.get('message')}" for w in waiting if w))
    return "; ".join(out)


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def test_chart_runs_the_image_in_container_mode_and_scales_and_uninstalls_cleanly(k8s_cluster, tmp_path):
    image = built_image("the container-mode e2e")
    repository, tag = image.rsplit(":", 1)
    suffix = uuid.uuid4().hex[:6]
    system, namespace, node = f"img-system-{suffix}", f"img-{suffix}", f"img-node-{suffix}"
    kubeconfig = str(k8s_cluster.kubeconfig)
    add_local_runtime_node(k8s_cluster, node, gpus=4)
    for ns in (system, namespace):
        k8s_cluster.kubectl("create", "namespace", ns)
    cluster = Cluster(k8s_cluster)
    runner = PodRunner(k8s_cluster.api_client(), tmp_path / "pods", namespaces=[system, namespace],
                       work_dir=tmp_path / "pod-workdirs", container_runtime="podman").start()
    runner_id = runner.options.container.runner_id
    installed = deleted = False
    endpoints = None
    try:
        scheduling = local_runtime_scheduling()
        helm("install", RELEASE, str(CHART), "--kubeconfig", kubeconfig, "--namespace", system,
             "--set", f"operator.image.repository={repository}", "--set", f"operator.image.tag={tag}",
             "--set", "operator.watch.mode=namespaced", "--set", f"operator.watch.namespaces={{{namespace}}}",
             "--set-json", f"operator.nodeSelector={json.dumps(scheduling['nodeSelector'])}",
             "--set-json", f"operator.tolerations={json.dumps(scheduling['tolerations'])}",
             "--set-json", "operator.extraArgs=[\"--resync-seconds=1\"]")
        installed = True
        wait_for(lambda: any(ready(p) for p in cluster.pods(system)), START_TIMEOUT_S, 1,
                 lambda: f"the operator pod Ready ({states(cluster, system)}; logs in {tmp_path / 'pods'})")

        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, inference_service(image))
        endpoints = ReadyEndpoints(cluster.api, namespace, NAME).start()

        def serving() -> bool:  # two ready engines, and the Service on a ready router that knows them
            status = cluster.infsvc(namespace).get("status") or {}
            return (status.get("readyReplicas") == 2 and bool(endpoints())
                    and endpoints.selector == router_labels(NAME))

        wait_for(serving, START_TIMEOUT_S, 1,
                 lambda: f"two ready engines and the router ({states(cluster, namespace)}; logs in {tmp_path / 'pods'})")
        # Every pod is a container of the image, run as its securityContext and resources say.
        running = containers(runner_id)
        engines = [p["metadata"]["name"] for p in cluster.pods(namespace, ENGINE_SELECTOR)]
        pods = [f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                for p in cluster.pods(namespace) + cluster.pods(system)]
        assert len(engines) == 2 and len(pods) == 5, pods  # two engines, two routers, the operator
        for pod in pods:
            assert pod in running, f"{pod} is not a container: {sorted(running)}"
            assert running[pod]["ImageName"] == image
            assert running[pod]["HostConfig"]["ReadonlyRootfs"] is True
            assert running[pod]["Config"]["User"].split(":")[0] not in ("", "0", "root")
        engine = running[f"{namespace}/{engines[0]}"]
        assert engine["HostConfig"]["Memory"] == 3 * 2**30, "resources.limits.memory is not --memory"
        assert "CAP_SYS_ADMIN" not in (engine["EffectiveCaps"] or [])

        # A chat completion through the InferenceService's Service (its selector: the router pod).
        url = endpoints()[0]
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=180, json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]

        def history(action: str) -> list[dict]:
            return [r for r in (cluster.infsvc(namespace).get("status") or {}).get("scalingHistory") or []
                    if r["action"] == action]

        # Idle, with minReplicas 1: the autoscaler scales down, and the drained pod's container goes.
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME,
                                                      {"spec": {"autoscaling": {"minReplicas": 1}}})
        wait_for(lambda: history("ScaleDown") and len(cluster.pods(namespace, ENGINE_SELECTOR)) == 1,
                 180, 1, "the autoscaler's scale-down to one engine")
        wait_for(lambda: len(containers(runner_id)) == 4, 60, 1, "the scaled-down engine's container removed")

        # Load: more requests than one engine's two sequences -> waiting requests -> scale-up; the load
        # goes on until the new engine is Ready (without it the autoscaler would scale down again).
        def scaled_up() -> bool:
            return bool(history("ScaleUp")) and (cluster.infsvc(namespace).get("status") or {}).get("readyReplicas") == 2

        async def load_until_scaled_up() -> None:
            async def load() -> None:
                for chunk in range(1, 1000):
                    await run_load(LoadSpec(url=url, rate=3.0, requests=None, duration=4, prompt_len=12,
                                            max_tokens=24, model=DEFAULT_MODEL, seed=chunk, timeout=240))

            sending = asyncio.create_task(load())
            try:
                while not scaled_up():
                    assert not sending.done(), sending.exception()
                    await asyncio.sleep(0.5)
            finally:
                sending.cancel()  # requests still in flight are abandoned; the engines see the disconnects

        asyncio.run(asyncio.wait_for(load_until_scaled_up(), START_TIMEOUT_S + 120))
        assert len(containers(runner_id)) == 5
        up = history("ScaleUp")[-1]
        assert (up["fromReplicas"], up["toReplicas"]) == (1, 2)
        assert [(r["fromReplicas"], r["toReplicas"]) for r in history("ScaleDown")][:1] == [(2, 1)]
        endpoints.stop()
        endpoints = None

        # Delete the InferenceService while the operator runs, then uninstall the chart.
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
        deleted = True
        wait_for(lambda: not cluster.pods(namespace), 180, 1, "the InferenceService's pods gone")
        helm("uninstall", RELEASE, "--kubeconfig", kubeconfig, "--namespace", system, "--wait", "--timeout", "120s")
        installed = False
        wait_for(lambda: not cluster.pods(system), 120, 1, "the operator pod gone")
        wait_for(lambda: not containers(runner_id), 60, 1, "every container removed")

        def left_in(ns: str) -> list[str]:
            """Every object of these kinds in `ns`, but what each namespace has from its creation."""
            listed = k8s_cluster.kubectl("get", NAMESPACED_KINDS, "-n", ns, "-o", "name").stdout.split()
            return [name for name in listed if name not in NAMESPACE_DEFAULTS]

        # The operator's objects go by owner references (the garbage collector); helm's at once.
        wait_for(lambda: not left_in(namespace), 60, 1, lambda: f"{namespace} empty (left: {left_in(namespace)})")
        assert not left_in(system), f"left behind by helm uninstall: {left_in(system)}"
        cluster_wide = k8s_cluster.kubectl("get", "clusterroles,clusterrolebindings,validatingadmissionpolicies,"
                                           "validatingadmissionpolicybindings", "-o", "name", "-l",
                                           f"app.kubernetes.io/instance={RELEASE}").stdout.split()
        assert not cluster_wide, f"cluster-scoped objects left behind: {cluster_wide}"
    finally:
        if endpoints is not None:
            endpoints.stop()
        if not deleted:
            k8s_cluster.kubectl("-n", namespace, "delete", "inferenceservices", "--all", "--wait=false", check=False)
        if installed:
            helm("uninstall", RELEASE, "--kubeconfig", kubeconfig, "--namespace", system, check=False)
        runner.stop()
        leftover = containers(runner_id)
        for ns in (system, namespace):
            k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        k8s_cluster.kubectl("delete", "node", node, "--wait=false", check=False)
        cluster.api.close()
    assert not leftover, f"containers left after the runner stopped: {sorted(leftover)}"
