"""The local pod runtime's translation of a pod into a command line and environment, as the
kubelet resolves env (envFrom, then env; configMapKeyRef, secretKeyRef, fieldRef; $(VAR))."""

from __future__ import annotations

import base64
import sys

import pytest

from iterserve.devcluster.podrunner.launch import LaunchError, build_launch, expand
from iterserve.devcluster.podrunner.probes import ProbeState
from iterserve.devcluster.podrunner.worker import prestop_seconds

CONFIGMAPS = {"engine": {"max_num_seqs": "12", "LEVEL": "debug"}}
SECRETS = {"admin": {"data": {"token": base64.b64encode(b"s3cret").decode()}}}


def configmaps(name, kind):
    return CONFIGMAPS.get(name)


def secrets(name, kind):
    from iterserve.devcluster.podrunner.launch import secret_data

    return secret_data(SECRETS[name]) if name in SECRETS else None


def pod(container: dict, **status) -> dict:
    base = {"name": "engine", "image": "ghcr.io/iterserve/engine:0.1.0", "command": ["iterserve", "serve"]}
    return {"metadata": {"name": "p-1", "namespace": "ns", "uid": "u-1"},
            "spec": {"nodeName": "local-0", "containers": [{**base, **container}]},
            "status": {"podIP": "127.10.0.7", **status}}


def test_env_sources_and_expansion_in_args(tmp_path):
    launch = build_launch(pod({
        "args": ["--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "$(SEQS)", "--log-level", "$(CFG_LEVEL)",
                 "--served-model-name", "$$(SEQS)-$(UNKNOWN)"],
        "envFrom": [{"configMapRef": {"name": "engine"}, "prefix": "CFG_"},
                    {"secretRef": {"name": "missing", "optional": True}}],
        "env": [{"name": "SEQS", "valueFrom": {"configMapKeyRef": {"name": "engine", "key": "max_num_seqs"}}},
                {"name": "ITERSERVE_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "GREETING", "value": "pod $(POD) with $(SEQS)"},
                {"name": "OMP_NUM_THREADS", "value": "3"}],
    }), configmaps, secrets, tmp_path, threads=1)
    assert launch.argv[:3] == [sys.executable, "-m", "iterserve.cli"]
    args = launch.argv[3:]
    assert args[0] == "serve"
    assert args[args.index("--max-num-seqs") + 1] == "12"
    assert args[args.index("--log-level") + 1] == "debug"
    assert args[args.index("--served-model-name") + 1] == "$(SEQS)-$(UNKNOWN)"
    assert args.count("--host") == 1 and args[-2:] == ["--host", "127.10.0.7"]
    assert (launch.host, launch.port) == ("127.10.0.7", 8000)
    env = launch.env
    assert env["ITERSERVE_ADMIN_TOKEN"] == "s3cret"
    assert env["GREETING"] == "pod p-1 with 12"
    assert env["CFG_max_num_seqs"] == "12"
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "1"  # the pod wins; else one thread
    assert env["HOME"] == str(tmp_path) and "KUBECONFIG" not in env


def test_empty_command_is_the_engine_entrypoint_and_port_from_the_container(tmp_path):
    launch = build_launch(pod({"command": None, "args": ["--fake-model"], "ports": [{"containerPort": 9000}]}),
                          configmaps, secrets, tmp_path)
    assert launch.argv[3:] == ["serve", "--fake-model", "--host", "127.10.0.7"]
    assert launch.port == 9000


@pytest.mark.parametrize("container, status, message", [
    ({"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]}, {},
     "env X: ConfigMap 'nope'"),
    ({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "other"}}}]}, {},
     "key 'other' not in 'admin' (secretKeyRef.key)"),
    ({"envFrom": [{"configMapRef": {"name": "nope"}}]}, {}, "envFrom: configMapRef 'nope' not found"),
    ({"command": ["python", "-m", "http.server"]}, {}, "only runs the project's own `iterserve`"),
    ({"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.hostname"}}}]}, {},
     "fieldRef.fieldPath 'spec.hostname' is not supported"),
    ({}, {"podIP": None}, "has no status.podIP yet"),
])
def test_clear_errors(tmp_path, container, status, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_launch(pod(container, **status), configmaps, secrets, tmp_path)


def test_optional_key_refs_are_skipped(tmp_path):
    launch = build_launch(pod({"env": [
        {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "k", "optional": True}}}]}),
        configmaps, secrets, tmp_path)
    assert "A" not in launch.env and "B" not in launch.env


def test_expand_escapes_and_unknowns():
    assert expand("$(A)/$$(A)/$(B)/$$$(A)", {"A": "x"}) == "x/$(A)/$(B)/$x"


def test_prestop_intents():
    assert prestop_seconds({"sleep": {"seconds": 5}}) == 5
    assert prestop_seconds({"exec": {"command": ["sleep", "3"]}}) == 3
    assert prestop_seconds({"exec": {"command": ["/bin/sh", "-c", "sleep 2.5"]}}) == 2.5
    assert prestop_seconds({"exec": {"command": ["curl", "-X", "POST", "localhost/admin/drain"]}}) is None
    assert prestop_seconds(None) is None


def test_probe_thresholds_flip_the_result(monkeypatch):
    results = iter([True, False, True, False, False, True])
    monkeypatch.setattr("iterserve.devcluster.podrunner.probes.check", lambda *a: next(results))
    probe = ProbeState.for_container("readiness", {"httpGet": {"path": "/ready", "port": 1}, "periodSeconds": 5,
                                                   "failureThreshold": 2, "initialDelaySeconds": 1}, started_at=100)
    assert not probe.ok and not probe.due(100.5) and probe.due(101)
    observed = [probe.run(101 + 5 * i, "127.0.0.1", {}) for i in range(6)]
    # one failure is not enough to turn a ready container unready; two in a row are
    assert observed == [True, True, True, True, False, True]
    assert probe.next_at == 101 + 25 + 5
