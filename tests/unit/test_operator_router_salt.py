"""The router's tenant salt key (operator/router_salt.py), through the reconcile on the in-memory
Kube: with spec.routing.tenantHeader, Secret <name>-tenant-salt (32 random bytes under `key`),
created once and never rewritten, owned by the InferenceService, mounted read-only into the
router pod template (so into every replica) with --tenant-salt-header and --tenant-salt-key-file,
which the router's own CLI reads back; nothing of it without the header or outside Router mode."""

from __future__ import annotations

import argparse
import base64
import copy

import pytest

from iterserve.operator import router_salt
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.reconcile import Reconciler
from iterserve.router.body import tenant_salt
from iterserve.router.cli import configure, options_from
from tests.unit.test_operator_value_flow import MemoryKube

SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 1, "engine": {"extraArgs": ["--fake-model"]},
        "routing": {"tenantHeader": "X-Tenant"}}


def _router_pod(kube: MemoryKube) -> dict:
    return kube.objects[("Deployment", "llm-router")]["spec"]["template"]["spec"]


def test_a_tenant_header_gets_one_random_salt_key_owned_by_the_service():
    kube = MemoryKube(copy.deepcopy(SPEC))
    Reconciler(kube).reconcile("ns", "llm")
    secret = kube.objects[("Secret", "llm-tenant-salt")]
    key = base64.b64decode(secret["data"]["key"])
    # 32 random bytes as URL-safe text: nothing a reader's strip() could cut
    assert len(base64.urlsafe_b64decode(key + b"=")) == 32 and key.isascii() and key == key.strip()
    assert set(secret["data"]) == {"key"}
    [owner] = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == "u1" and owner["controller"] is True
    other = router_salt.build_secret(type("O", (), {"name": "llm", "namespace": "ns", "uid": "u1"})())
    assert other["data"]["key"] != secret["data"]["key"]  # fresh randomness per build
    assert "Created" in kube.events


def test_the_salt_key_is_never_rewritten_by_later_reconciles():
    kube = MemoryKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    first = kube.objects[("Secret", "llm-tenant-salt")]["data"]["key"]
    for _ in range(2):
        reconciler.reconcile("ns", "llm")
    assert kube.objects[("Secret", "llm-tenant-salt")]["data"]["key"] == first
    assert kube.writes.count(("Secret", "llm-tenant-salt")) == 1


def test_every_router_replica_mounts_the_one_key_read_only_and_the_router_reads_it(tmp_path):
    kube = MemoryKube(copy.deepcopy(SPEC))
    Reconciler(kube).reconcile("ns", "llm")
    deployment = kube.objects[("Deployment", "llm-router")]
    assert deployment["spec"]["replicas"] == 2  # one pod template: both replicas get the same volume
    pod = _router_pod(kube)
    [container] = pod["containers"]
    assert {"name": "tenant-salt", "mountPath": "/etc/iterserve/tenant-salt", "readOnly": True} \
        in container["volumeMounts"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "tenant-salt"]
    assert volume["secret"] == {"secretName": "llm-tenant-salt", "defaultMode": 0o444,
                                "items": [{"key": "key", "path": "key"}]}

    # The router's CLI takes the args as rendered; the file the kubelet would project is the key.
    key = base64.b64decode(kube.objects[("Secret", "llm-tenant-salt")]["data"]["key"])
    (tmp_path / "key").write_bytes(key)
    args = [str(tmp_path / "key") if a == "/etc/iterserve/tenant-salt/key" else a for a in container["args"]]
    parser = argparse.ArgumentParser()
    configure(parser)
    options = options_from(parser.parse_args(args))
    assert options.tenant_salt_header == "X-Tenant" and options.tenant_salt_key == key
    assert tenant_salt(options.tenant_salt_key, "a") == tenant_salt(key, "a")


@pytest.mark.parametrize("routing", [{}, {"mode": "None", "tenantHeader": "X-Tenant"},
                                     {"mode": "Gateway", "tenantHeader": "X-Tenant"}])
def test_without_a_tenant_header_in_router_mode_there_is_no_key_and_no_mount(routing):
    kube = MemoryKube({**copy.deepcopy(SPEC), "routing": routing})
    Reconciler(kube).reconcile("ns", "llm")
    assert ("Secret", "llm-tenant-salt") not in kube.objects
    for (kind, _), obj in kube.objects.items():
        if kind == "Deployment":
            assert "tenant-salt" not in str(obj["spec"]["template"]), obj["metadata"]["name"]


def test_a_salt_secret_someone_else_owns_is_a_conflict_not_adopted():
    kube = MemoryKube(copy.deepcopy(SPEC))
    planted = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llm-tenant-salt", "namespace": "ns",
                                                                  "resourceVersion": "1"},
               "data": {"key": base64.b64encode(b"k" * 32).decode()}}
    kube.objects[("Secret", "llm-tenant-salt")] = planted
    outcome = Reconciler(kube).reconcile("ns", "llm")
    assert outcome.result != "applied" and ("Deployment", "llm-router") not in kube.objects
    assert kube.objects[("Secret", "llm-tenant-salt")] == planted


@pytest.mark.parametrize("header", ["X Tenant", "X-Tenant\r\nX-Evil: 1", "-x", "", "x" * 65, "X:Tenant"])
def test_a_tenant_header_that_is_not_a_header_name_is_refused_naming_the_field(header):
    with pytest.raises(ValueError, match="tenant_header|tenantHeader"):
        InferenceServiceSpec.model_validate({"model": {"uri": "m"}, "routing": {"tenantHeader": header}})
