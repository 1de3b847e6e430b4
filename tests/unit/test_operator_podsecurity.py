"""What an InferenceService may not ask of its pods (operator/podsecurity.py): each rule refuses
its fields naming them, an allowed rule lets them through, what the operator builds from any
accepted spec passes the restricted profile's container rules, and the chart's admission policy
is the same rules, generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.operator import podsecurity, resources
from iterserve.operator.validation import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _spec(patch=None, volume=None) -> dict:
    model = {"uri": "m", **({"volume": volume} if volume is not None else {})}
    return {"model": model, **({"podTemplatePatch": patch} if patch is not None else {})}


def _engine(**security) -> dict:
    return {"spec": {"containers": [{"name": "engine", "securityContext": security}]}}


REFUSED = [
    ("privileged", _spec(_engine(privileged=True)), "spec.podTemplatePatch.spec.containers[engine].securityContext.privileged"),
    ("privileged", _spec(_engine(allowPrivilegeEscalation=True)), "containers[engine].securityContext.allowPrivilegeEscalation"),
    ("hostNamespaces", _spec({"spec": {"hostNetwork": True}}), "spec.podTemplatePatch.spec.hostNetwork"),
    ("hostNamespaces", _spec({"spec": {"hostPID": True}}), "spec.podTemplatePatch.spec.hostPID"),
    ("hostNamespaces", _spec({"spec": {"containers": [{"name": "s", "image": "b", "ports": [{"containerPort": 80, "hostPort": 80}]}]}}),
     "containers[s].ports[0].hostPort"),
    ("hostPath", _spec(volume={"hostPath": {"path": "/models"}}), "spec.model.volume.hostPath"),
    ("hostPath", _spec({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}),
     "spec.podTemplatePatch.spec.volumes[root].hostPath"),
    ("volumeTypes", _spec(volume={"nfs": {"server": "nas", "path": "/models"}}), "spec.model.volume"),
    ("capabilities", _spec(_engine(capabilities={"add": ["SYS_ADMIN"]})), "securityContext.capabilities.add"),
    ("runAsRoot", _spec({"spec": {"securityContext": {"runAsUser": 0}}}), "spec.podTemplatePatch.spec.securityContext.runAsUser"),
    ("runAsRoot", _spec(_engine(runAsNonRoot=False)), "containers[engine].securityContext.runAsNonRoot"),
    ("serviceAccount", _spec({"spec": {"serviceAccountName": "admin"}}), "spec.podTemplatePatch.spec.serviceAccountName"),
    ("serviceAccount", _spec({"spec": {"automountServiceAccountToken": True}}), "automountServiceAccountToken"),
    ("securityContext", _spec({"spec": {"securityContext": None}}), "spec.podTemplatePatch.spec.securityContext"),
    ("securityContext", _spec({"spec": {"containers": [{"name": "engine", "securityContext": None}]}}),
     "containers[engine].securityContext"),
    ("securityContext", _spec(_engine(capabilities={"drop": []})), "securityContext.capabilities.drop"),
    ("securityContext", _spec({"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}}),
     "seccompProfile.type"),
    ("appArmor", _spec({"spec": {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}}),
     "spec.podTemplatePatch.spec.securityContext.appArmorProfile.type"),
    ("appArmor", _spec(_engine(appArmorProfile={"type": "Unconfined"})), "containers[engine].securityContext.appArmorProfile"),
    ("appArmor", _spec({"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}}}),
     "spec.podTemplatePatch.metadata.annotations"),
    ("seLinux", _spec({"spec": {"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}}),
     "spec.podTemplatePatch.spec.securityContext.seLinuxOptions.type"),
    ("seLinux", _spec(_engine(seLinuxOptions={"user": "system_u"})), "containers[engine].securityContext.seLinuxOptions.user"),
    ("seLinux", _spec(_engine(seLinuxOptions={"role": "sysadm_r"})), "containers[engine].securityContext.seLinuxOptions.role"),
    ("sysctls", _spec({"spec": {"securityContext": {"sysctls": [{"name": "kernel.shm_rmid_forced", "value": "0"}]}}}),
     "spec.podTemplatePatch.spec.securityContext.sysctls"),
    ("nodeName", _spec({"spec": {"nodeName": "gpu-node-7"}}), "spec.podTemplatePatch.spec.nodeName"),
    ("runtimeClass", _spec({"spec": {"runtimeClassName": "runc-unsandboxed"}}), "spec.podTemplatePatch.spec.runtimeClassName"),
    ("serviceAccount", _spec({"spec": {"volumes": [{"name": "tok", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "audience": "vault"}}]}}]}}),
     "spec.podTemplatePatch.spec.volumes[tok].projected.sources[0].serviceAccountToken"),
]


@pytest.mark.parametrize("rule,spec,field", REFUSED, ids=[f"{r}:{f.rsplit('.', 1)[-1]}" for r, _, f in REFUSED])
def test_each_rule_refuses_its_field_naming_it_unless_allowed(rule, spec, field):
    with pytest.raises(SpecError) as error:
        parse_spec(spec)
    assert field in error.value.field and f"admissionPolicy.allow: [{rule}]" in str(error.value)
    assert [v.rule for v in podsecurity.violations(spec)] == [rule]
    parse_spec(spec, frozenset({rule}))  # an admin allowed it


def test_a_runtime_class_passes_only_when_allowed_by_name():
    spec = _spec({"spec": {"runtimeClassName": "nvidia"}})
    parse_spec(spec, frozenset({f"{podsecurity.RUNTIME_CLASS_ALLOWED}nvidia"}))
    with pytest.raises(SpecError, match="admissionPolicy.runtimeClasses"):
        parse_spec(spec, frozenset({f"{podsecurity.RUNTIME_CLASS_ALLOWED}kata"}))


ACCEPTED = [
    _spec(_engine(readOnlyRootFilesystem=False, runAsUser=2000)),
    _spec({"metadata": {"labels": {"team": "a"}}, "spec": {"containers": [
        {"name": "sidecar", "image": "busybox"}]}}),
    _spec(_engine(capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]})),
    _spec(volume={"persistentVolumeClaim": {"claimName": "models"}}),
    _spec(volume={"csi": {"driver": "x"}}),
    _spec({"metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "runtime/default",
                                        "container.apparmor.security.beta.kubernetes.io/side": "localhost/tight"}},
           "spec": {"securityContext": {"seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"},
                                        "appArmorProfile": {"type": "RuntimeDefault"}}}}),
    _spec({"spec": {"volumes": [{"name": "cfg", "projected": {"sources": [{"configMap": {"name": "c"}}]}}]}}),
]


@pytest.mark.parametrize("spec", ACCEPTED,
                         ids=["own-user", "sidecar", "net-bind", "pvc", "csi", "confined-lsm", "projected-configmap"])
def test_what_keeps_the_profile_is_accepted(spec):
    assert podsecurity.violations(spec) == []
    parse_spec(spec)


def test_containers_a_patch_adds_get_the_restricted_container_settings():
    spec = parse_spec(_spec({"spec": {"containers": [{"name": "sidecar", "image": "busybox"}],
                                      "initContainers": [{"name": "fetch", "image": "busybox",
                                                          "securityContext": {"runAsUser": 3000}}]}}))
    pod = resources.build_deployment(resources.Owner("llm", "ns", "u"), spec)["spec"]["template"]["spec"]
    for container in pod["containers"] + pod["initContainers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["runAsNonRoot"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["initContainers"][0]["securityContext"]["runAsUser"] == 3000


def test_an_added_container_that_adds_a_capability_keeps_drop_all():
    # The merge used to be one level deep: `capabilities: {add: [...]}` replaced `{drop: [ALL]}`.
    spec = parse_spec(_spec({"spec": {"containers": [{"name": "web", "image": "nginx", "securityContext": {
        "capabilities": {"add": ["NET_BIND_SERVICE"]}}}]}}))
    pod = resources.build_deployment(resources.Owner("llm", "ns", "u"), spec)["spec"]["template"]["spec"]
    web = next(c for c in pod["containers"] if c["name"] == "web")
    assert web["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}


def test_the_chart_policy_is_generated_from_the_rules():
    path = ROOT / podsecurity.ADMISSION_POLICY_FILE
    assert path.read_text() == podsecurity.admission_policy_template(), "run `make crds`"
    for rule in podsecurity.RULES:
        assert f'{{{{- if not (has "{rule.name}" $allow) }}}}' in path.read_text()
