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
                {"name": "OMP_NUM_THREADS", "value": "3"},
                {"name": "HOME", "value": "/tmp"}],  # as the operator's Deployments set it: replaced, not refused
    }), configmaps, secrets, tmp_path, threads=1)
    assert launch.argv[:5] == [sys.executable, "-I", "-u", "-m", "iterserve.cli"]
    args = launch.argv[5:]
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
    assert launch.argv[5:] == ["serve", "--fake-model", "--host", "127.10.0.7"]
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
    # iterserve, but not serve: `crd -o FILE` would write a file of the pod's choosing
    ({"command": ["iterserve", "crd", "-o", "/tmp/owned"]}, {}, "only runs `iterserve serve`"),
    ({"command": ["/usr/bin/iterserve"], "args": ["crd"]}, {}, "only runs `iterserve serve`"),
    ({"args": ["--step-log", "/tmp/owned.jsonl"]}, {}, "argument '--step-log' is not one"),
    ({"args": ["--step-log=/tmp/owned.jsonl"]}, {}, "argument '--step-log=/tmp/owned.jsonl' is not one"),
    ({"args": ["--step", "/tmp/owned.jsonl"]}, {}, "argument '--step' is not one"),  # argparse would expand it
    ({"args": ["--admin-token-file", "/etc/shadow"]}, {}, "argument '--admin-token-file' is not one"),
    ({"args": ["--model", "/root/.ssh/id_rsa"]}, {}, "only serves model aliases"),
    ({"args": ["--model=../weights"]}, {}, "only serves model aliases"),
    ({"args": ["--served-model-name", "--step-log", "x"]}, {}, "--served-model-name needs a value"),
    ({"args": ["stray"]}, {}, "argument 'stray' is not one"),
    ({"args": ["--fake-model=yes"]}, {}, "--fake-model takes no value"),
    ({"env": [{"name": "PYTHONPATH", "value": "/tmp/evil"}]}, {}, "env PYTHONPATH: the local runtime refuses"),
    ({"env": [{"name": "LD_PRELOAD", "value": "/tmp/evil.so"}, {"name": "PYTHONSTARTUP", "value": "/tmp/x.py"}]},
     {}, "env LD_PRELOAD, PYTHONSTARTUP:"),
    ({"envFrom": [{"configMapRef": {"name": "engine"}, "prefix": "PYTHON"}]}, {}, "env PYTHONLEVEL, PYTHONmax_num_seqs"),
    ({"env": [{"name": "PATH", "value": "/tmp/bin"}]}, {}, "env PATH:"),
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


def test_allowed_flags_pass_in_both_forms(tmp_path):
    launch = build_launch(pod({"args": ["--model=smollm2-135m", "--max-num-seqs", "4", "--fake-step-time-scale", "-1",
                                        "--no-chunked-prefill", "--kv-cache-memory=64MiB", "--host=0.0.0.0"]}),
                          configmaps, secrets, tmp_path)
    assert launch.argv[5:] == ["serve", "--model=smollm2-135m", "--max-num-seqs", "4", "--fake-step-time-scale", "-1",
                               "--no-chunked-prefill", "--kv-cache-memory=64MiB", "--host", "127.10.0.7"]


def test_the_process_env_is_the_pods_plus_a_fixed_few(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/runtime-own")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/runtime-own.so")
    launch = build_launch(pod({"env": [{"name": "LEVEL", "value": "x"}]}), configmaps, secrets, tmp_path)
    assert not [key for key in launch.env if key.startswith(("PYTHON", "LD_"))]
    assert launch.env["LEVEL"] == "x" and launch.env["TMPDIR"] == str(tmp_path)


def test_probes_dial_the_pod_ip_whatever_host_they_name():
    import http.server
    import threading

    from iterserve.devcluster.podrunner.probes import check

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        # the pod IP answers; a probe naming another host (here one where nothing listens) still goes there
        assert check({"httpGet": {"host": "127.0.0.2", "port": port, "path": "/"}}, "127.0.0.1", {}, 2)
        assert check({"tcpSocket": {"host": "127.0.0.2", "port": port}}, "127.0.0.1", {}, 2)
        # and a pod IP where nothing listens fails even when the named host would answer
        assert not check({"httpGet": {"host": "127.0.0.1", "port": port, "path": "/"}}, "127.0.0.2", {}, 2)
        assert not check({"tcpSocket": {"host": "127.0.0.1", "port": port}}, "127.0.0.2", {}, 2)
    finally:
        server.shutdown()


def test_every_serve_flag_is_either_allowed_or_refused():
    """A new `serve` flag must be classified here before pods may use it."""
    import argparse

    from iterserve.devcluster.podrunner.launch import REFUSED_SERVE_FLAGS, SERVE_FLAGS
    from iterserve.engine.server.cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    flags = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert set(flags) == set(SERVE_FLAGS) | set(REFUSED_SERVE_FLAGS)
    assert {f: v for f, v in flags.items() if f in SERVE_FLAGS} == SERVE_FLAGS  # and whether each takes a value


def test_every_router_flag_is_either_allowed_or_refused():
    """A new `router` flag must be classified here before router pods may use it."""
    import argparse

    from iterserve.devcluster.podrunner.launch import REFUSED_ROUTER_FLAGS, ROUTER_FLAGS
    from iterserve.router.cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    flags = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}
    assert set(flags) == set(ROUTER_FLAGS) | set(REFUSED_ROUTER_FLAGS)
    assert {f: v for f, v in flags.items() if f in ROUTER_FLAGS} == ROUTER_FLAGS  # and whether each takes a value


def router_pod(args: list[str], **spec) -> dict:
    body = pod({"command": ["iterserve", "router"], "args": args})
    body["spec"].update({"serviceAccountName": "chat-router", **spec})
    return body


def test_a_router_pod_runs_with_a_token_of_its_service_account(tmp_path):
    asked = []

    def token_kubeconfig(pod_body, service_account, folder):
        asked.append((pod_body["metadata"]["uid"], service_account, folder))
        return folder / "serviceaccount.kubeconfig"

    launch = build_launch(router_pod(["--infsvc", "chat", "-n", "ns", "--host", "0.0.0.0", "--port", "8000",
                                      "--scrape-interval", "0.2"]),
                          configmaps, secrets, tmp_path, token_kubeconfig=token_kubeconfig)
    args = launch.argv[5:]
    assert args[0] == "router" and args[args.index("--host") + 1] == "127.10.0.7" and args.count("--host") == 1
    assert args[-2:] == ["--kubeconfig", str(tmp_path / "serviceaccount.kubeconfig")]
    assert asked == [("u-1", "chat-router", tmp_path)]
    assert (launch.host, launch.port) == ("127.10.0.7", 8000)


@pytest.mark.parametrize("args, spec, message", [
    (["--endpoints", "http://127.0.0.1:22"], {}, "argument '--endpoints' is not one"),
    (["--infsvc", "chat", "--kubeconfig", "/root/.kube/config"], {}, "argument '--kubeconfig' is not one"),
    (["--infsvc", "chat", "--kubeconfig=/root/.kube/config"], {}, "argument '--kubeconfig=/root/.kube/config'"),
    (["--infsvc", "chat", "-n", "kube-system"], {}, "routes only to its own namespace"),
    (["--infsvc", "chat", "--namespace=other"], {}, "routes only to its own namespace"),
    (["--port", "8000"], {}, "needs --infsvc NAME"),
    (["--infsvc", "chat"], {"automountServiceAccountToken": False}, "automountServiceAccountToken is false"),
    (["--infsvc", "chat", "--max-num-seqs", "4"], {}, "argument '--max-num-seqs' is not one"),  # a serve flag
])
def test_router_pods_clear_errors(tmp_path, args, spec, message):
    with pytest.raises(LaunchError, match=message):
        build_launch(router_pod(args, **spec), configmaps, secrets, tmp_path,
                     token_kubeconfig=lambda p, sa, folder: folder / "k")


def test_no_router_pods_without_credentials_to_give(tmp_path):
    with pytest.raises(LaunchError, match="runs no router pods"):
        build_launch(router_pod(["--infsvc", "chat"]), configmaps, secrets, tmp_path)
