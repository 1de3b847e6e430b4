"""Container mode of the local pod runtime, as command lines: a pod's image, command, env,
securityContext, resources and volumes become the right `podman run` flags; what the runtime
cannot honour is refused naming the field; leftover containers are told apart by their runner.
(The e2e tests/e2e/test_image_cluster.py runs these containers for real.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iterserve.devcluster.podrunner import container as mode
from iterserve.devcluster.podrunner.launch import LaunchError
from iterserve.devcluster.podrunner.probes import check
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.resources import pod_template

IMAGE = "localhost/iterserve:test"
POD_IP = "127.10.3.4"
OPTIONS = mode.ContainerOptions("123-abcd", threads=1, api_server="https://127.0.0.1:6443")
# The engine's ConfigMap (max_num_seqs) and admin Secret (token), the namespace's root CA.
DATA = {"chat-engine": {"max_num_seqs": "8"}, "chat-admin": {"token": "s3cret-admin"},
        "kube-root-ca.crt": {"ca.crt": "CA PEM"}}


@pytest.fixture(autouse=True)
def local_image(monkeypatch):
    monkeypatch.setattr(mode, "image_present", lambda image: image == IMAGE)
    monkeypatch.setattr(mode, "_image_user", lambda image: "10001:10001")
    monkeypatch.setattr(mode, "cgroup_limits", lambda: (True, True))


def lookup(name: str, kind: str) -> dict[str, str] | None:
    return DATA.get(name)


def tokens(pod: dict, account: str) -> mode.ServiceAccountToken:
    return mode.ServiceAccountToken(f"token-of-{account}", b"CA PEM", pod["metadata"]["namespace"], OPTIONS.api_server)


def engine_pod() -> dict:
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "smollm2-135m"}, "engine": {
        "image": IMAGE, "resources": {"limits": {"memory": "2Gi", "cpu": "1500m"}}}})
    return {"metadata": {"name": "chat-0", "namespace": "team", "uid": "0123456789abcdef"},
            "spec": pod_template(spec, "chat")["spec"], "status": {"podIP": POD_IP}}


def operator_pod() -> dict:
    """As the chart's Deployment makes it, with the API server's kube-api-access volume."""
    return {"metadata": {"name": "op-0", "namespace": "system", "uid": "fedcba9876543210"}, "spec": {
        "serviceAccountName": "iterserve",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
        "containers": [{
            "name": "operator", "image": IMAGE, "command": ["iterserve"],
            "args": ["operator", "run", "--namespace=team", "--liveness=http://0.0.0.0:8080/healthz",
                     "--metrics-port=9090"],
            "ports": [{"name": "health", "containerPort": 8080}],
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                             {"name": "kube-api-access-x", "mountPath": mode.SERVICE_ACCOUNT_DIR, "readOnly": True}]}],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi", "medium": "Memory"}},
                    {"name": "kube-api-access-x", "projected": {"sources": [
                        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace",
                                                    "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}]},
        "status": {"podIP": POD_IP}}


def launch(pod: dict, tmp_path: Path, log=lambda text: None):
    return mode.build_container_launch(pod, lookup, lookup, tmp_path / "pod", OPTIONS, tokens, log)


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def test_an_engine_pod_runs_its_image_as_its_security_context_and_limits_say(tmp_path):
    argv = launch(engine_pod(), tmp_path).argv
    image_at = argv.index(IMAGE)
    run, inside = argv[:image_at], argv[image_at + 1:]
    assert run[:2] == ["podman", "run"] and {"--rm", "--read-only"} <= set(run)
    assert flag_values(run, "--network") == ["host"] and flag_values(run, "--pull") == ["never"]
    assert flag_values(run, "--user") == ["10001:10001"]
    assert flag_values(run, "--cap-drop") == ["ALL"] and "no-new-privileges" in flag_values(run, "--security-opt")
    assert flag_values(run, "--memory") == [str(2 * 2**30)] and flag_values(run, "--cpus") == ["1.5"]
    assert f"{mode.CONTAINER_LABEL}=123-abcd" in flag_values(run, "--label")
    # The emptyDir at /tmp is a folder of the pod's own, writable by any uid of the pod.
    (tmp_volume,) = flag_values(run, "--volume")
    host, inside_path, access = tmp_volume.split(":")
    assert (inside_path, access) == ("/tmp", "rw") and oct(Path(host).stat().st_mode & 0o7777) == "0o1777"
    # The engine listens on the pod IP, whatever --host it asked for.
    assert flag_values(run, "--entrypoint") == ["iterserve"] and inside[0] == "serve"
    assert flag_values(inside, "--host") == [POD_IP]
    # The Secret's value reaches the container through a 0600 env file, never the command line.
    assert not any("s3cret" in arg for arg in argv)
    (env_file,) = flag_values(run, "--env-file")
    assert "ITERSERVE_ADMIN_TOKEN=s3cret-admin\n" in Path(env_file).read_text()
    assert "KUBERNETES_SERVICE_HOST=127.0.0.1\n" in Path(env_file).read_text()
    assert Path(env_file).stat().st_mode & 0o077 == 0


def test_the_operator_pod_gets_its_token_volume_and_binds_its_ports_to_the_pod_ip(tmp_path):
    argv = launch(operator_pod(), tmp_path).argv
    run, inside = argv[:argv.index(IMAGE)], argv[argv.index(IMAGE) + 1:]
    assert flag_values(inside, "--liveness") == [f"http://{POD_IP}:8080/healthz"]
    assert flag_values(inside, "--metrics-host") == [POD_IP]
    assert flag_values(run, "--user") == ["65532:65532"] and flag_values(run, "--group-add") == ["65532"]
    assert flag_values(run, "--tmpfs") == [f"/tmp:rw,nosuid,nodev,size={64 * 2**20},mode=1777"]
    (projected,) = flag_values(run, "--volume")
    folder, path, access = projected.split(":")
    assert (path, access) == (mode.SERVICE_ACCOUNT_DIR, "ro")
    assert {f.name: f.read_text() for f in Path(folder).iterdir()} == {
        "token": "token-of-iterserve", "ca.crt": "CA PEM", "namespace": "system"}


def test_an_operator_without_a_liveness_endpoint_gets_none(tmp_path):
    pod = operator_pod()
    pod["spec"]["containers"][0]["args"][3] = "--liveness=none"
    inside = launch(pod, tmp_path).argv
    assert "--liveness=none" in inside and "--liveness" not in inside


def test_without_an_injected_token_volume_the_runtime_mounts_the_token_itself(tmp_path):
    pod = operator_pod()
    container = pod["spec"]["containers"][0]
    container["volumeMounts"] = container["volumeMounts"][:1]
    volumes = flag_values(launch(pod, tmp_path).argv, "--volume")
    assert [v.split(":")[1] for v in volumes] == [mode.SERVICE_ACCOUNT_DIR]
    pod["spec"]["automountServiceAccountToken"] = False
    assert flag_values(launch(pod, tmp_path / "again").argv, "--volume") == []


@pytest.mark.parametrize(("change", "named"), [
    (lambda c, s: c["securityContext"].update(runAsUser=0), "runAsUser 0"),
    (lambda c, s: c["securityContext"].update(privileged=True), "securityContext.privileged"),
    (lambda c, s: c["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), "capabilities.add"),
    (lambda c, s: c["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccompProfile.type"),
    (lambda c, s: s["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
     or c["volumeMounts"].append({"name": "host", "mountPath": "/host"}), "volume type hostPath"),
    (lambda c, s: c["volumeMounts"].append({"name": "tmp", "mountPath": "/x", "subPath": "a"}), "subPath"),
    (lambda c, s: c.update(command=["sh", "-c", "nc -l 80"]), "container mode runs `iterserve serve`"),
    (lambda c, s: c.update(image="busybox:latest"), "make image"),
])
def test_what_the_runtime_cannot_honour_is_refused_naming_the_field(tmp_path, change, named):
    pod = engine_pod()
    change(pod["spec"]["containers"][0], pod["spec"])
    with pytest.raises(LaunchError, match=named.replace("(", r"\(").replace("`", "`")):
        launch(pod, tmp_path)


def test_a_missing_image_waits_as_err_image_never_pull(tmp_path):
    pod = engine_pod()
    pod["spec"]["containers"][0]["image"] = "ghcr.io/elsewhere/engine:9"
    with pytest.raises(LaunchError) as raised:
        launch(pod, tmp_path)
    assert raised.value.reason == "ErrImageNeverPull"


def test_limits_podman_cannot_enforce_are_recorded_not_dropped_silently(tmp_path, monkeypatch):
    monkeypatch.setattr(mode, "cgroup_limits", lambda: (False, False))
    lines: list[str] = []
    argv = launch(engine_pod(), tmp_path, lines.append).argv
    assert "--memory" not in argv and "--cpus" not in argv
    assert any("limits.memory 2Gi not enforced" in line for line in lines)
    assert any("limits.cpu 1500m not enforced" in line for line in lines)


def test_reaping_takes_this_runners_containers_or_those_of_runners_that_died():
    dead = 2**22 + 12345  # above pid_max's default: no such process
    listing = [
        {"Names": ["mine"], "Labels": {mode.CONTAINER_LABEL: f"{os.getpid()}-abcd"}},
        {"Names": ["alive-other"], "Labels": {mode.CONTAINER_LABEL: f"{os.getpid()}-ffff"}},
        {"Names": ["orphan"], "Labels": {mode.CONTAINER_LABEL: f"{dead}-eeee"}},
        {"Names": ["not-ours"], "Labels": {}},
    ]
    assert mode.containers_to_reap(listing, f"{os.getpid()}-abcd") == ["mine"]
    assert mode.containers_to_reap(listing) == ["orphan"]


def test_exec_probes_run_in_the_container_where_the_runtime_can():
    probe = {"exec": {"command": ["cat", "/tmp/ready"]}}
    ran: list[tuple[list[str], float]] = []
    assert check(probe, POD_IP, {}, 2.0, lambda command, timeout: ran.append((command, timeout)) or False) is False
    assert ran == [(["cat", "/tmp/ready"], 2.0)]
    assert check(probe, POD_IP, {}, 2.0) is True  # process mode: counted as a success, as before


def test_container_mode_without_podman_says_why_and_an_unknown_runtime_is_named(monkeypatch):
    from iterserve.devcluster.podrunner import PodRunner

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="podman is not installed.*use container_runtime process"):
        PodRunner(None, Path("/nonexistent"), namespaces=["a"], container_runtime="podman")
    with pytest.raises(ValueError, match="container_runtime 'docker': use one of process, podman"):
        PodRunner(None, Path("/nonexistent"), namespaces=["a"], container_runtime="docker")
