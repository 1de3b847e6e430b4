"""The KV transfer key of a disaggregated InferenceService (operator/kv_auth.py), through the
reconcile on the in-memory Kube: Secret <name>-kv-auth with 32 random bytes under `key`, created
once and never rewritten, owned by the InferenceService, mounted read-only in prefill, decode and
router pods with --kv-auth-key-file; nothing of it without disaggregation."""

from __future__ import annotations

import base64
import copy

from iterserve.operator import kv_auth
from iterserve.operator.reconcile import Reconciler
from tests.unit.test_operator_value_flow import MemoryKube

SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 1, "engine": {"extraArgs": ["--fake-model"]},
        "disaggregation": {"enabled": True}}
POD_DEPLOYMENTS = ("llm", "llm-prefill", "llm-router")


def _pod_spec(kube: MemoryKube, name: str) -> dict:
    return kube.objects[("Deployment", name)]["spec"]["template"]["spec"]


def test_a_disaggregated_service_gets_one_random_key_owned_by_it():
    kube = MemoryKube(copy.deepcopy(SPEC))
    Reconciler(kube).reconcile("ns", "llm")
    secret = kube.objects[("Secret", "llm-kv-auth")]
    key = base64.b64decode(secret["data"]["key"])
    # 32 random bytes as URL-safe text: nothing a reader's strip() could cut
    assert len(base64.urlsafe_b64decode(key + b"=")) == 32 and key.isascii() and key == key.strip()
    assert set(secret["data"]) == {"key"}
    [owner] = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == "u1" and owner["controller"] is True
    other = kv_auth.build_secret(type("O", (), {"name": "llm", "namespace": "ns", "uid": "u1"})())
    assert other["data"]["key"] != secret["data"]["key"]  # fresh randomness per build


def test_the_key_is_never_rewritten_by_later_reconciles():
    kube = MemoryKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    first = kube.objects[("Secret", "llm-kv-auth")]["data"]["key"]
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")
    assert kube.objects[("Secret", "llm-kv-auth")]["data"]["key"] == first
    assert kube.writes.count(("Secret", "llm-kv-auth")) == 1


def test_prefill_decode_and_router_pods_mount_the_key_read_only_and_name_it():
    kube = MemoryKube(copy.deepcopy(SPEC))
    Reconciler(kube).reconcile("ns", "llm")
    for name in POD_DEPLOYMENTS:
        pod = _pod_spec(kube, name)
        [container] = pod["containers"]
        args = container["args"]
        assert args[args.index("--kv-auth-key-file") + 1] == "/etc/iterserve/kv-auth/key", name
        assert {"name": "kv-auth", "mountPath": "/etc/iterserve/kv-auth", "readOnly": True} in container["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-auth")
        assert volume["secret"]["secretName"] == "llm-kv-auth"
        assert volume["secret"]["items"] == [{"key": "key", "path": "key"}]


def test_without_disaggregation_there_is_no_key_and_no_mount():
    spec = {k: v for k, v in SPEC.items() if k != "disaggregation"}
    kube = MemoryKube(copy.deepcopy(spec))
    Reconciler(kube).reconcile("ns", "llm")
    assert ("Secret", "llm-kv-auth") not in kube.objects
    for name in ("llm", "llm-router"):
        assert "--kv-auth-key-file" not in str(_pod_spec(kube, name))
