"""The local pod runtime reads a key file for a pod only from a secret volume of that pod: a
path anywhere else (this machine's /etc/passwd, a path climbing out of the mount) is refused,
and the Secret's bytes reach the process unchanged."""

from __future__ import annotations

import base64

import pytest

from iterserve.devcluster.podrunner.launch import LaunchError, build_launch, secret_data

KEY = bytes(range(256))[:32]  # not UTF-8: must survive the lookup's decode


def _pod(key_file: str, mount_path: str = "/etc/iterserve/kv-auth", volume: dict | None = None) -> dict:
    volume = volume or {"secret": {"secretName": "llm-kv-auth", "items": [{"key": "key", "path": "key"}]}}
    container = {"name": "engine", "command": ["iterserve", "serve"],
                 "args": ["--fake-model", "--port", "8000", "--kv-auth-key-file", key_file],
                 "volumeMounts": [{"name": "kv-auth", "mountPath": mount_path, "readOnly": True}]}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "status": {"podIP": "127.10.0.9"},
            "spec": {"containers": [container], "volumes": [{"name": "kv-auth", **volume}]}}


def _secrets(name, kind):
    return {"llm-kv-auth": secret_data({"data": {"key": base64.b64encode(KEY).decode()}})}.get(name)


def test_the_key_from_a_secret_volume_reaches_the_process_byte_for_byte(tmp_path):
    argv = build_launch(_pod("/etc/iterserve/kv-auth/key"), lambda *_: None, _secrets, tmp_path).argv
    path = argv[argv.index("--kv-auth-key-file") + 1]
    assert path.startswith(str(tmp_path))
    with open(path, "rb") as handle:
        assert handle.read() == KEY


@pytest.mark.parametrize("key_file", ["/etc/passwd", "/etc/iterserve/kv-auth/../../passwd", "/etc/iterserve/kv-authx"])
def test_a_path_outside_the_secret_volume_is_refused(tmp_path, key_file):
    with pytest.raises(LaunchError, match="only from a secret volume"):
        build_launch(_pod(key_file), lambda *_: None, _secrets, tmp_path)


def test_a_non_secret_volume_does_not_count(tmp_path):
    with pytest.raises(LaunchError, match="only from a secret volume"):
        build_launch(_pod("/etc/iterserve/kv-auth/key", volume={"emptyDir": {}}), lambda *_: None, _secrets, tmp_path)


def test_a_missing_secret_waits_like_the_kubelet(tmp_path):
    with pytest.raises(LaunchError) as error:
        build_launch(_pod("/etc/iterserve/kv-auth/key"), lambda *_: None, lambda *_: None, tmp_path)
    assert error.value.reason == "ContainerCreating"
