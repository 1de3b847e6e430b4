"""What an InferenceService may not ask for: the parts of `spec.podTemplatePatch` and
`spec.model.volume` that would weaken the `restricted` Pod Security profile of its engine pods.

The operator creates the engine Deployment with its own rights, so a user who may create
InferenceServices but not privileged pods must not get them through the patch. The rules are
written once, here, and enforced twice: by the API server, as the chart's
ValidatingAdmissionPolicy (`admission_policy_template()` writes it, as CEL), and by the operator
itself (`violations()`, reported as the InvalidSpec condition) for clusters without the policy.
Each rule has a name; an admin allows a rule by name (chart value `admissionPolicy.allow`, which
also becomes the operator's `--allow-pod-security` flags). RuntimeClasses are allowed one by one
(chart value `admissionPolicy.runtimeClasses`, the operator's `--allow-runtime-class`): a runtime
class picks the node's container runtime, and an unknown one may run without the sandbox the
others give.

The rules follow the Pod Security Standards (baseline + restricted) for what a pod patch can set,
plus what a patch could use to leave the operator's placement and identity: nodeName (skips the
scheduler, and with it quotas on node pools) and projected ServiceAccount tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

# Where the checks look, as (field path shown in messages, CEL expression of the list of items).
# A field path ending in [*] stands for every item of a list.
_PATCH = "spec.podTemplatePatch.spec"
SCOPES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "pod": ((_PATCH, ("podTemplatePatch", "spec")),),
    "container": ((f"{_PATCH}.containers[*]", ("podTemplatePatch", "spec", "containers", "*")),
                  (f"{_PATCH}.initContainers[*]", ("podTemplatePatch", "spec", "initContainers", "*"))),
    "volume": ((f"{_PATCH}.volumes[*]", ("podTemplatePatch", "spec", "volumes", "*")),
               ("spec.model.volume", ("model", "volume"))),
    "podMetadata": (("spec.podTemplatePatch.metadata", ("podTemplatePatch", "metadata")),),
}
# Volume types the restricted profile allows (besides these, only `name`).
RESTRICTED_VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret")
ALLOWED_ADDED_CAPABILITIES = ("NET_BIND_SERVICE",)
# SELinux types the baseline profile allows (an unset or empty type too).
ALLOWED_SELINUX_TYPES = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
# The legacy per-container AppArmor annotation and the values baseline allows on it.
APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
ALLOWED_APPARMOR_ANNOTATION = ("runtime/default", "localhost/")  # exact, then prefix
# `allowed` entries of this form allow one RuntimeClass (from --allow-runtime-class).
RUNTIME_CLASS_ALLOWED = "runtimeClass="


@dataclass(frozen=True)
class Check:
    """One field test under a scope item. `test`: "true" (set to true), "present" (set at all),
    "nonempty" (a non-empty string or list), "equals" (== value), "not_one_of" (a value not in
    value), "null" (set to null: the merge deletes the operator's value), "other_than" (a list
    holding an item not in value), "lacks" (a list without value), "keys_other_than" (a map with a
    key not in value), "apparmor_annotation" (a map with a legacy AppArmor key whose profile is
    not runtime/default or localhost/*), "not_allowed_runtime_class" (a name the admin did not
    allow)."""

    scope: str
    path: tuple[str, ...]
    test: str
    value: Any = None


@dataclass(frozen=True)
class Rule:
    name: str
    what: str  # completes "... would weaken the restricted Pod Security profile: <what>"
    checks: tuple[Check, ...]


def _c(scope: str, path: str, test: str, value: Any = None) -> Check:
    return Check(scope, tuple(path.split(".")), test, value)


RULES: tuple[Rule, ...] = (
    Rule("privileged", "privileged containers or privilege escalation", (
        _c("container", "securityContext.privileged", "true"),
        _c("container", "securityContext.allowPrivilegeEscalation", "true"),
    )),
    Rule("hostNamespaces", "the node's network, PID or IPC namespace, or its ports", (
        _c("pod", "hostNetwork", "true"),
        _c("pod", "hostPID", "true"),
        _c("pod", "hostIPC", "true"),
        _c("container", "ports.*.hostPort", "present"),
    )),
    Rule("hostPath", "a hostPath volume (the node's filesystem)", (
        _c("volume", "hostPath", "present"),
    )),
    Rule("volumeTypes", "a volume type the restricted profile does not allow", (
        _c("volume", "", "keys_other_than", ("name", "hostPath", *RESTRICTED_VOLUME_TYPES)),
    )),
    Rule("capabilities", "added Linux capabilities", (
        _c("container", "securityContext.capabilities.add", "other_than", ALLOWED_ADDED_CAPABILITIES),
    )),
    Rule("runAsRoot", "running as root (user 0, or runAsNonRoot false)", (
        _c("pod", "securityContext.runAsUser", "equals", 0),
        _c("pod", "securityContext.runAsNonRoot", "equals", False),
        _c("container", "securityContext.runAsUser", "equals", 0),
        _c("container", "securityContext.runAsNonRoot", "equals", False),
    )),
    Rule("serviceAccount", "another ServiceAccount, or its token mounted", (
        _c("pod", "serviceAccountName", "present"),
        _c("pod", "serviceAccount", "present"),
        _c("pod", "automountServiceAccountToken", "true"),
        _c("volume", "projected.sources.*.serviceAccountToken", "present"),
    )),
    Rule("securityContext", "a removed or loosened security context", (
        _c("pod", "securityContext", "null"),
        _c("pod", "securityContext.runAsNonRoot", "null"),
        _c("pod", "securityContext.runAsUser", "null"),
        _c("pod", "securityContext.seccompProfile", "null"),
        _c("pod", "securityContext.seccompProfile.type", "equals", "Unconfined"),
        _c("container", "securityContext", "null"),
        _c("container", "securityContext.allowPrivilegeEscalation", "null"),
        _c("container", "securityContext.capabilities", "null"),
        _c("container", "securityContext.capabilities.drop", "lacks", "ALL"),
        _c("container", "securityContext.seccompProfile.type", "equals", "Unconfined"),
        _c("container", "securityContext.procMount", "equals", "Unmasked"),
    )),
    Rule("appArmor", "an Unconfined AppArmor profile", (
        _c("pod", "securityContext.appArmorProfile.type", "equals", "Unconfined"),
        _c("container", "securityContext.appArmorProfile.type", "equals", "Unconfined"),
        _c("podMetadata", "annotations", "apparmor_annotation"),
    )),
    Rule("seLinux", "an SELinux type other than the container ones, or an SELinux user or role", (
        _c("pod", "securityContext.seLinuxOptions.type", "not_one_of", ALLOWED_SELINUX_TYPES),
        _c("pod", "securityContext.seLinuxOptions.user", "nonempty"),
        _c("pod", "securityContext.seLinuxOptions.role", "nonempty"),
        _c("container", "securityContext.seLinuxOptions.type", "not_one_of", ALLOWED_SELINUX_TYPES),
        _c("container", "securityContext.seLinuxOptions.user", "nonempty"),
        _c("container", "securityContext.seLinuxOptions.role", "nonempty"),
    )),
    Rule("sysctls", "kernel parameters (sysctls)", (
        _c("pod", "securityContext.sysctls", "nonempty"),
    )),
    Rule("nodeName", "a node named directly (nodeName skips the scheduler)", (
        _c("pod", "nodeName", "nonempty"),
    )),
    Rule("runtimeClass", "a RuntimeClass the cluster admin has not allowed", (
        _c("pod", "runtimeClassName", "not_allowed_runtime_class"),
    )),
)
RULE_NAMES = tuple(rule.name for rule in RULES)


def _shown(scope_path: str, path: tuple[str, ...]) -> str:
    return ".".join([scope_path, *(("[*]" if p == "*" else p) for p in path if p)]).replace(".[*]", "[*]")


# ------------------------------------------------------------------------------ in the operator


@dataclass(frozen=True)
class Violation:
    rule: str
    field: str  # the offending field, e.g. spec.podTemplatePatch.spec.containers[engine].securityContext.privileged
    message: str


def _walk(node: Any, path: tuple[str, ...], shown: str) -> Iterator[tuple[str, bool, Any]]:
    """(field path, whether the key is present, value) for every match of `path` under `node`."""
    if not path:
        yield shown, True, node
        return
    head, rest = path[0], path[1:]
    if head == "*":
        for index, item in enumerate(node if isinstance(node, list) else ()):
            label = item.get("name", index) if isinstance(item, dict) else index
            yield from _walk(item, rest, f"{shown}[{label}]")
        return
    if head == "":
        yield from _walk(node, rest, shown)
        return
    if not isinstance(node, dict) or head not in node:
        yield f"{shown}.{head}", False, None
        return
    yield from _walk(node[head], rest, f"{shown}.{head}")


def _apparmor_unconfined(annotations: Any) -> bool:
    if not isinstance(annotations, dict):
        return False
    exact, prefix = ALLOWED_APPARMOR_ANNOTATION
    return any(isinstance(key, str) and key.startswith(APPARMOR_ANNOTATION_PREFIX)
               and not (value == exact or (isinstance(value, str) and value.startswith(prefix)))
               for key, value in annotations.items())


def _fails(check: Check, present: bool, value: Any, runtime_classes: frozenset[str] = frozenset()) -> bool:
    if not present:
        return False
    match check.test:
        case "true":
            return value is True
        case "present":
            return value is not None
        case "nonempty":
            return isinstance(value, str | list | dict) and len(value) > 0
        case "equals":
            return value is not None and type(value) is type(check.value) and value == check.value
        case "not_one_of":
            return value is not None and value not in check.value
        case "apparmor_annotation":
            return _apparmor_unconfined(value)
        case "not_allowed_runtime_class":
            return value is not None and value not in runtime_classes
        case "null":
            return value is None
        case "other_than":
            return isinstance(value, list) and any(item not in check.value for item in value)
        case "lacks":
            return isinstance(value, list) and check.value not in value
        case "keys_other_than":
            return isinstance(value, dict) and any(key not in check.value for key in value)
    raise ValueError(f"unknown test {check.test}")


def violations(spec: dict, allowed: Iterable[str] = ()) -> list[Violation]:
    """Every rule the spec (the wire form: camelCase dicts) breaks, unless `allowed` names it."""
    allowed = set(allowed)
    runtime_classes = frozenset(a.removeprefix(RUNTIME_CLASS_ALLOWED) for a in allowed
                                if a.startswith(RUNTIME_CLASS_ALLOWED))
    found = []
    for rule in RULES:
        if rule.name in allowed:
            continue
        for check in rule.checks:
            for _, keys in SCOPES[check.scope]:
                for field, present, value in _walk(spec, (*keys, *check.path), "spec"):
                    if _fails(check, present, value, runtime_classes):
                        found.append(Violation(rule.name, field, _message(rule, field)))
    return found


def _message(rule: Rule, field: str) -> str:
    how = (f"the chart value admissionPolicy.runtimeClasses (one class) or admissionPolicy.allow: [{rule.name}]"
           if rule.name == "runtimeClass" else f"the chart value admissionPolicy.allow: [{rule.name}]")
    return f"{field}: would weaken the restricted Pod Security profile ({rule.what}); a cluster admin may allow it with {how}"


# ------------------------------------------------------------------- in the API server, as CEL


def _cel_path(base: str, path: Iterable[str]) -> list[str]:
    """The guarded steps from `base` down a path of map keys: each must be present and not null."""
    steps, current = [], base
    for key in path:
        current = f"{current}.{key}"
        steps.append(current)
    return steps


def _cel_items(keys: tuple[str, ...]) -> tuple[str, str]:
    """(CEL expression of the scope's items as a list, a guard saying they exist)."""
    wildcard = "*" in keys
    head = keys[: keys.index("*")] if wildcard else keys
    steps = _cel_path("object.spec", head)
    guard = " && ".join(f"has({s}) && {s} != null" for s in steps)
    return (steps[-1] if wildcard else f"[{steps[-1]}]"), guard


def _cel_test(check: Check, item: str) -> str:
    parts = [p for p in check.path if p]
    if "*" in parts:  # one nested list (ports[*].hostPort)
        i = parts.index("*")
        inner = Check(check.scope, tuple(parts[i + 1:]), check.test, check.value)
        steps = _cel_path(item, parts[:i])
        guard = " && ".join(f"has({s}) && {s} != null" for s in steps)
        return f"({guard} && {steps[-1]}.exists(n, {_cel_test(inner, 'n')}))"
    if not parts:
        target, guards = item, []
    else:
        steps = _cel_path(item, parts)
        target = steps[-1]
        guards = [f"has({s}) && {s} != null" for s in steps[:-1]] + [f"has({target})"]
    value = json.dumps(check.value)
    exact, prefix = ALLOWED_APPARMOR_ANNOTATION
    test = {
        "true": f"{target} == true",
        "present": f"{target} != null",
        "nonempty": f"{target} != null && size({target}) > 0",
        "equals": f"{target} == {value}",
        "not_one_of": f"{target} != null && !({target} in {value})",
        "apparmor_annotation": (f"{target} != null && {target}.exists(k, k.startsWith({json.dumps(APPARMOR_ANNOTATION_PREFIX)})"
                                f" && !({target}[k] == {json.dumps(exact)} || {target}[k].startsWith({json.dumps(prefix)})))"),
        # $runtimeClasses: a CEL list the chart template builds from admissionPolicy.runtimeClasses.
        "not_allowed_runtime_class": f"{target} != null && !({target} in {{{{ $runtimeClasses }}}})",
        "null": f"{target} == null",
        "other_than": f"{target} != null && {target}.exists(c, !(c in {value}))",
        "lacks": f"{target} != null && !({value} in {target})",
        "keys_other_than": f"{target} != null && {target}.exists(k, !(k in {value}))",
    }[check.test]
    return "(" + " && ".join([*guards, test]) + ")"


def cel_validations(rule: Rule) -> list[dict[str, str]]:
    """The ValidatingAdmissionPolicy validations of one rule: one per checked field."""
    out = []
    for check in rule.checks:
        for shown, keys in SCOPES[check.scope]:
            items, guard = _cel_items(keys)
            expression = f"!({guard} && {items}.exists(i, {_cel_test(check, 'i')}))"
            out.append({"expression": expression, "message": _message(rule, _shown(shown, check.path)),
                        "reason": "Forbidden"})
    return out


ADMISSION_POLICY_FILE = "charts/iterserve/templates/admission-policy.yaml"


def admission_policy_template() -> str:
    """The chart's ValidatingAdmissionPolicy and its binding, as a Helm template: one validation
    per checked field, each left out when `admissionPolicy.allow` names its rule."""
    lines = [
        "{{/* Generated from operator/podsecurity.py by `iterserve operator admission-policy`. Do not edit:",
        "     run `make crds` (a unit test fails when this file drifts from the rules). */}}",
        "{{- if .Values.admissionPolicy.enabled }}",
        "{{- $allow := .Values.admissionPolicy.allow }}",
        f"{{{{- $checked := list {' '.join(json.dumps(n) for n in RULE_NAMES)} }}}}",
        "{{- range $allow }}{{- $checked = without $checked . }}{{- end }}",
        "{{- $quoted := list }}",
        "{{- range .Values.admissionPolicy.runtimeClasses }}{{- $quoted = append $quoted (printf \"'%s'\" .) }}{{- end }}",
        "{{- $runtimeClasses := printf \"[%s]\" (join \", \" $quoted) }}",
        "{{- if eq (len $checked) 0 }}",
        '{{- fail "admissionPolicy.allow allows every rule: set admissionPolicy.enabled=false instead" }}',
        "{{- end }}",
        "apiVersion: admissionregistration.k8s.io/v1",
        "kind: ValidatingAdmissionPolicy",
        "metadata:",
        '  name: {{ include "iterserve.fullname" . }}-pod-security',
        "  labels:",
        '    {{- include "iterserve.labels" . | nindent 4 }}',
        "spec:",
        "  failurePolicy: Fail",
        "  matchConstraints:",
        "    resourceRules:",
        "      - apiGroups: [iterserve.dev]",
        '        apiVersions: ["*"]',
        "        operations: [CREATE, UPDATE]",
        "        resources: [inferenceservices]",
        "  validations:",
    ]
    for rule in RULES:
        lines.append(f'    {{{{- if not (has "{rule.name}" $allow) }}}}')
        for validation in cel_validations(rule):
            lines.append(f"    - expression: {json.dumps(validation['expression'])}")
            lines.append(f"      message: {json.dumps(validation['message'])}")
            lines.append(f"      reason: {validation['reason']}")
        lines.append("    {{- end }}")
    lines += [
        "---",
        "apiVersion: admissionregistration.k8s.io/v1",
        "kind: ValidatingAdmissionPolicyBinding",
        "metadata:",
        '  name: {{ include "iterserve.fullname" . }}-pod-security',
        "  labels:",
        '    {{- include "iterserve.labels" . | nindent 4 }}',
        "spec:",
        '  policyName: {{ include "iterserve.fullname" . }}-pod-security',
        "  validationActions: [Deny]",
        '  {{- if eq .Values.operator.watch.mode "namespaced" }}',
        "  matchResources:",
        "    namespaceSelector:",
        "      matchExpressions:",
        "        - key: kubernetes.io/metadata.name",
        "          operator: In",
        "          values: {{ toJson .Values.operator.watch.namespaces }}",
        "  {{- end }}",
        "{{- end }}",
    ]
    return "\n".join(lines) + "\n"
