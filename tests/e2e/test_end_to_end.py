"""End to end: an InferenceService from examples/ becomes an engine that answers requests.

ITERSERVE_E2E_TARGET picks the cluster:
- `local` (default, CI): the `k8s_cluster` control plane, the operator as a local process under
  a ServiceAccount with exactly its RBAC, and, since KWOK pods run no containers, the test plays
  kubelet for the engine container: it runs the Deployment's own command, args and env (the
  ConfigMap's max_num_seqs, the Secret's admin token) as a real `iterserve serve` bound to the
  pod's IP (KWOK hands out 127.10.x.x). That checks the operator's pod spec against the real
  engine CLI, then requests go to the pod IP.
- `kind` (a machine with Docker, kind, helm and kubectl): create a kind cluster, build and load
  the image (image/Containerfile), `helm install` charts/iterserve, apply the sample, port-forward
  its Service to loopback and send the same requests. See e2e/README.md.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client

from tests.operator_fixture import (
    REPO,
    OperatorProcess,
    ensure_node,
    example,
    install_crd,
    operator_namespace,
    wait_for,
)

TARGET = os.environ.get("ITERSERVE_E2E_TARGET", "local")
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.cluster]
NAME = "smollm2"
PROMPT = "The capital of France is"


def check_engine(url: str, admin_token: str) -> None:
    """What a user of the InferenceService does, and what the autoscaler does."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    print(f"\n{PROMPT!r} -> {text!r}")
    assert text.strip()
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "llm_scheduler_waiting_requests" in metrics and "llm_gpu_kv_cache_usage_fraction" in metrics
    config = httpx.patch(f"{url}/admin/config", json={"max_num_seqs": 8}, timeout=10,
                         headers={"Authorization": f"Bearer {admin_token}"})
    assert config.status_code == 200 and config.json()["max_num_seqs"] == 8, config.text


# ------------------------------------------------------------------------------ local target


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _container_env(core: client.CoreV1Api, namespace: str, container) -> dict[str, str]:
    env = {}
    for var in container.env or []:
        if var.value is not None:
            env[var.name] = var.value
        elif var.value_from.config_map_key_ref is not None:
            ref = var.value_from.config_map_key_ref
            env[var.name] = core.read_namespaced_config_map(ref.name, namespace).data[ref.key]
        elif var.value_from.secret_key_ref is not None:
            ref = var.value_from.secret_key_ref
            env[var.name] = base64.b64decode(core.read_namespaced_secret(ref.name, namespace).data[ref.key]).decode()
    return env


def _run_as_kubelet(pod, env: dict[str, str], log: Path) -> subprocess.Popen:
    # KWOK reuses 127.10.0.1, .2, ... in every cluster: a concurrent run on this machine may hold it.
    with socket.socket() as probe:
        if probe.connect_ex((pod.status.pod_ip, 8000)) == 0:
            raise RuntimeError(f"another process already listens on {pod.status.pod_ip}:8000 "
                               "(a concurrent cluster run on this machine?)")
    container = pod.spec.containers[0]
    argv = [_expand(a, env) for a in [*container.command, *container.args]]
    argv[argv.index("--host") + 1] = pod.status.pod_ip  # 0.0.0.0 in a pod is its own IP here
    argv[0] = str(Path(sys.executable).parent / "iterserve")
    print(f"\nengine pod {pod.metadata.name} ({pod.status.pod_ip}): {' '.join(argv[1:])}")
    with open(log, "wb") as out:
        # Not from the repository root, whose folder operator/ would shadow the stdlib module.
        return subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)


def run_local(k8s_cluster, tmp_path: Path) -> None:
    install_crd(k8s_cluster)
    ensure_node(k8s_cluster)
    namespace, kubeconfig = operator_namespace(k8s_cluster, "e2e")
    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log").start()
    engine = None
    try:
        k8s_cluster.kubectl("-n", namespace, "apply", "-f", str(REPO / "examples" / "minimal.yaml"))
        with k8s_cluster.api_client() as api:
            core = client.CoreV1Api(api)
            selector = f"app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance={NAME}"  # not the router's
            pod = wait_for(lambda: next((p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                                         if p.status.pod_ip), None), 60, 0.5, "an engine pod with an IP")
            env = _container_env(core, namespace, pod.spec.containers[0])
            assert env["ITERSERVE_MAX_NUM_SEQS"] == "16"
            engine = _run_as_kubelet(pod, env, tmp_path / "engine.log")
            url = f"http://{pod.status.pod_ip}:8000"

            def ready():
                assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                try:
                    return httpx.get(f"{url}/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False
            wait_for(ready, 300, 1, "the engine to load the embedded model")
            check_engine(url, env["ITERSERVE_ADMIN_TOKEN"])
            status = yaml.safe_load(k8s_cluster.kubectl("-n", namespace, "get", "infsvc", NAME, "-o", "yaml").stdout)
            assert any(c["type"] == "Ready" and c["status"] == "True" for c in status["status"]["conditions"])

            # Termination as the kubelet does it: preStop (a sleep), SIGTERM, then SIGKILL at the
            # grace period. The engine must drain and exit inside it.
            grace = pod.spec.termination_grace_period_seconds
            engine.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert engine.wait(grace) == 0
            print(f"engine exited {time.monotonic() - started:.1f} s after SIGTERM (grace period {grace} s)")
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        operator.stop()


# ------------------------------------------------------------------------------- kind target


def _sh(*cmd: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd))
    return subprocess.run(cmd, check=True, timeout=timeout, text=True, **kwargs)


def run_kind(tmp_path: Path) -> None:
    for tool in ("docker", "kind", "helm", "kubectl"):
        assert shutil.which(tool), f"ITERSERVE_E2E_TARGET=kind needs {tool} on PATH"
    cluster = os.environ.get("ITERSERVE_E2E_KIND_CLUSTER", "iterserve-e2e")
    image = "ghcr.io/iterserve/engine:0.1.0"  # the CRD's default engine image and the chart's
    kubeconfig = str(tmp_path / "kubeconfig")
    kube = ["--kubeconfig", kubeconfig]
    _sh("kind", "create", "cluster", "--name", cluster, "--kubeconfig", kubeconfig, "--wait", "120s")
    forward = None
    try:
        _sh("docker", "build", "-f", str(REPO / "image" / "Containerfile"), "--build-arg",
            "BASE=python:3.11-slim-bookworm", "-t", image, str(REPO), timeout=3600)
        _sh("kind", "load", "docker-image", image, "--name", cluster)
        _sh("helm", "install", "iterserve", str(REPO / "charts" / "iterserve"), *kube,
            "--namespace", "iterserve-system", "--create-namespace", "--wait", "--timeout", "5m")
        sample = example("minimal.yaml")
        sample["spec"]["engine"]["imagePullPolicy"] = "Never"
        _sh("kubectl", *kube, "apply", "-f", "-", input=yaml.safe_dump(sample))
        _sh("kubectl", *kube, "wait", f"infsvc/{NAME}", "--for=condition=Ready", "--timeout=600s")
        port = 18000
        forward = subprocess.Popen(["kubectl", *kube, "port-forward", f"service/{NAME}", f"{port}:8000"])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _reachable(url), 30, 0.5, "the port-forward")
        token = _sh("kubectl", *kube, "get", "secret", f"{NAME}-admin", "-o", "jsonpath={.data.token}",
                    capture_output=True).stdout
        check_engine(url, base64.b64decode(token).decode())
    finally:
        if forward is not None:
            forward.terminate()
        if not os.environ.get("ITERSERVE_E2E_KEEP_CLUSTER"):
            _sh("kind", "delete", "cluster", "--name", cluster)


def _reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_inference_service_serves_requests(request, tmp_path):
    assert TARGET in ("local", "kind"), f"ITERSERVE_E2E_TARGET must be local or kind, not {TARGET!r}"
    if TARGET == "kind":
        run_kind(tmp_path)
    else:
        run_local(request.getfixturevalue("k8s_cluster"), tmp_path)
