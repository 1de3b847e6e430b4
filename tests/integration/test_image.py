"""The iterserve image, run as a pod runs it: the engine, the router, the operator, and a clean
shutdown.

Containers start with podman + runc under the chart's pod security context (read-only root,
uid 10001, every capability dropped, no new privileges, a tmpfs at /tmp) on the host network,
bound to 127.0.0.1. The image is built once per machine and reused by its content-hash tag
(image/build.py --if-missing): the first build downloads and installs torch (minutes, see
docs/image.md); later runs with unchanged sources reuse it. Without podman or runc these tests
skip and say why; the consistency checks at the bottom run everywhere. The operator test also
needs the local control plane (`make cluster-tools`).
"""

from __future__ import annotations

import base64
import os
import re
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from iterserve.devcluster import podman
from iterserve.devcluster.kubeconfig import current_cluster
from tests.image_fixture import FIRST_BUILD_TIMEOUT_S, built_image
from tests.operator_fixture import (
    ensure_node,
    example,
    free_port,
    install_crd,
    operator_namespace,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
DRAIN_S = 5
GRACE_S = DRAIN_S + 15  # the pod's grace period: drain, plus the margin the operator adds
READY_TIMEOUT_S = 240


def container_test(test):
    """Slow and needs podman; the first such test may pay for building the image."""
    for mark in (pytest.mark.slow, pytest.mark.image, pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S)):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def image() -> str:
    return built_image()


def wait_ready(name: str, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{name} not ready at {url} in {READY_TIMEOUT_S} s:\n{podman.logs(name)}")


class Container:
    def __init__(self, image: str, role: str, command: list[str], port: int) -> None:
        self.name = f"iterserve-test-{role}-{os.getpid()}-{port}"
        self.url = f"http://127.0.0.1:{port}"
        podman.remove(self.name)
        podman.run_detached(image, self.name, command)


@pytest.fixture(scope="module")
def runtime_changes(image: str) -> set[str]:
    """What podman itself changes in any container (mount points for /etc/hosts and the like),
    seen in one that runs `true`: the image's own processes must change nothing beyond it."""
    name = f"iterserve-test-baseline-{os.getpid()}"
    podman.remove(name)
    podman.run_detached(image, name, ["true"])
    try:
        assert podman.wait_exit(name, 60) == 0, podman.logs(name)
        return set(podman.changed_paths(name))
    finally:
        podman.remove(name)


@pytest.fixture(scope="module")
def engine(image: str):
    port = free_port()
    box = Container(image, "engine", ["iterserve", "serve", "--host", "127.0.0.1", "--port",
                                      str(port), "--drain-timeout", str(DRAIN_S)], port)
    try:
        wait_ready(box.name, box.url + "/ready")
        yield box
    finally:
        podman.remove(box.name)


@pytest.fixture(scope="module")
def router(image: str, engine: Container):
    port = free_port()
    box = Container(image, "router", ["iterserve", "router", "--endpoints", engine.url,
                                      "--host", "127.0.0.1", "--port", str(port)], port)
    try:
        wait_ready(box.name, box.url + "/ready")
        yield box
    finally:
        podman.remove(box.name)


def chat(url: str) -> dict:
    body = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


@container_test
def test_the_engine_in_the_image_answers_a_chat_completion_with_the_embedded_model(engine):
    reply = chat(engine.url)
    assert reply["choices"][0]["message"]["content"].strip()
    assert reply["usage"]["completion_tokens"] > 0
    # The image has no compiler: the GGUF, w8a8, fused and attention kernels are its prebuilt ones.
    logs = podman.logs(engine.name)
    assert " ready in " in logs and "unavailable" not in logs and "dequantized weight" not in logs, logs[-3000:]


@container_test
def test_the_engine_in_the_image_answers_health_and_metrics(engine):
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(engine.url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "vllm:num_requests_running" in metrics.text


@container_test
def test_the_router_in_the_image_proxies_to_the_engine_in_the_image(engine, router):
    direct = chat(engine.url)
    routed = chat(router.url)
    # Greedy decoding: the same answer whichever way the request went.
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 200


@container_test
def test_sigterm_stops_both_with_exit_0_in_the_grace_period_and_nothing_written_outside_tmp(
        engine, router, runtime_changes):
    for box in (router, engine):
        started = time.monotonic()
        code = podman.terminate(box.name, GRACE_S)
        assert code == 0, (f"{box.name}: exit {code} (None: still running after {GRACE_S} s)"
                           f"\n{podman.logs(box.name)}")
        assert time.monotonic() - started < GRACE_S
        written = [p for p in podman.changed_paths(box.name)
                   if p not in runtime_changes and not p.startswith("/tmp")]
        assert written == [], f"{box.name} wrote outside /tmp: {written}"


def pod_kubeconfig(kubeconfig: Path, folder: Path) -> Path:
    """The ServiceAccount kubeconfig as a pod would get it: self-contained (the CA inline, since
    no host path exists inside) and readable by uid 10001 (a Secret volume's default mode)."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = current_cluster(kubeconfig)
    if "certificate-authority" in cluster:
        ca = Path(cluster.pop("certificate-authority")).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    for entry in config["clusters"]:
        entry["cluster"] = cluster
    out = folder / "kubeconfig"
    out.write_text(yaml.safe_dump(config))
    out.chmod(0o644)
    return out


def ready_replicas(cluster, namespace: str, name: str) -> int:
    out = cluster.kubectl("-n", namespace, "get", "infsvc", name, "-o",
                          "jsonpath={.status.readyReplicas}").stdout.strip()
    return int(out or 0)


@container_test
@pytest.mark.cluster
def test_the_operator_in_the_image_reconciles_an_example_on_the_control_plane(
        image, k8s_cluster, tmp_path):
    install_crd(k8s_cluster)
    ensure_node(k8s_cluster)
    namespace, kubeconfig = operator_namespace(k8s_cluster, "image")
    liveness, metrics = free_port(), free_port()
    name = f"iterserve-test-operator-{os.getpid()}"
    podman.remove(name)
    podman.run_detached(
        image, name,
        ["iterserve", "operator", "run", "-n", namespace, "--kubeconfig", "/var/run/iterserve/kubeconfig",
         "--resync-seconds", "2", "--liveness", f"http://127.0.0.1:{liveness}/healthz",
         "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics)],
        read_only_files={pod_kubeconfig(kubeconfig, tmp_path): "/var/run/iterserve/kubeconfig"})
    try:
        wait_ready(name, f"http://127.0.0.1:{liveness}/healthz")
        sample = example("minimal.yaml")
        k8s_cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(sample))
        infsvc = sample["metadata"]["name"]
        try:
            wait_for(lambda: ready_replicas(k8s_cluster, namespace, infsvc) == 1, 120, 0.5,
                     "the InferenceService reconciled by the operator in the image")
        except Exception:
            print(podman.logs(name))
            raise
        assert httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).status_code == 200
        code = podman.terminate(name, GRACE_S)
        assert code == 0, f"operator: exit {code}\n{podman.logs(name)}"
        forbidden = [line for line in podman.logs(name).splitlines() if "Forbidden" in line]
        assert not forbidden, forbidden
    finally:
        podman.remove(name)


def test_without_podman_the_image_tests_say_why(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = podman.unavailable_reason()
    assert reason is not None and "podman is not installed" in reason
    assert "system-packages.sh" in reason


def test_make_image_tags_what_the_chart_and_the_crd_pull_by_default():
    from iterserve.operator.models import DEFAULT_ENGINE_IMAGE

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "charts" / "iterserve" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "iterserve" / "values.yaml").read_text())
    image = values["operator"]["image"]
    tag = image["tag"] or chart["appVersion"]
    assert f"{image['repository']}:{tag}" == f"ghcr.io/iterserve/engine:{version}"
    assert DEFAULT_ENGINE_IMAGE == f"ghcr.io/iterserve/engine:{version}"
    assert image["pullPolicy"] == "IfNotPresent"  # a locally built or kind-loaded image works


def test_the_content_hash_covers_every_path_the_ignore_file_lets_into_the_build():
    build = (REPO / "image" / "build.py").read_text()
    ignore = (REPO / "image" / "Containerfile.dockerignore").read_text()
    let_in = re.findall(r"^!(\S+?)/?$", ignore, flags=re.M)
    for path in let_in:
        assert f'"{path}"' in build, f"image/build.py's content hash misses {path}"
