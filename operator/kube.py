"""Every Kubernetes API call the operator makes (the reconcile's and the autoscaler's), in one
place, on plain dicts.

Each method names the RBAC rule it needs (operator/rbac.py lists them all for the Helm chart).
Owned objects are written with server-side apply under one field manager: applying an unchanged
manifest is a no-op on the server, and fields someone edited by hand are taken back.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from iterserve.operator.models import API_VERSION, GROUP, KIND, PLURAL, VERSION
from iterserve.operator.status import timestamp, utcnow

FIELD_MANAGER = "iterserve-operator"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


def _json(response) -> dict[str, Any]:
    return json.loads(response.data)


def not_found(exc: Exception) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def conflict(exc: Exception) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


def invalid(exc: Exception) -> bool:
    """The API server refused the object itself (422 Invalid, 400 BadRequest)."""
    return isinstance(exc, ApiException) and exc.status in (400, 422)


def server_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


class Kube:
    def __init__(self, api_client: client.ApiClient):
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    # discovery (no RBAC rule: every authenticated user may read it)
    def inference_services_discoverable(self) -> bool:
        """Whether API discovery lists the CRD's resource yet (kopf resolves resources once, at start)."""
        return self.api_resource_served(GROUP, VERSION, PLURAL)

    def api_resource_served(self, group: str, version: str, plural: str) -> bool:
        """Whether API discovery lists group/version's `plural` (e.g. a CRD another project installs)."""
        api = self.core.api_client
        request = api.param_serialize("GET", f"/apis/{group}/{version}", auth_settings=["BearerToken"])
        response = api.call_api(*request)
        response.read()
        if response.status == 404:
            return False
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason)
        return any(r.get("name") == plural for r in json.loads(response.data).get("resources", []))

    def inference_services_listable(self, namespace: str | None) -> bool:
        """Whether listing answers (a fresh CRD's storage answers 429 while it initializes)."""
        try:
            if namespace is None:
                self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1, _preload_content=False)
            else:
                self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, limit=1,
                                                          _preload_content=False)
        except ApiException as exc:
            if exc.status in (404, 429, 503):
                return False
            raise
        return True

    # iterserve.dev inferenceservices: get, list; inferenceservices/status: patch
    def get_inference_service(self, namespace: str, name: str) -> dict | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def scale_inference_service(self, namespace: str, name: str, replicas: int) -> dict:
        """spec.replicas, as the builtin autoscaler sets it (in External mode nothing here does)."""
        return _json(self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}}, _preload_content=False))

    def scale_prefill_pool(self, namespace: str, name: str, replicas: int) -> dict:
        """spec.disaggregation.prefill.replicas, as the builtin autoscaler sets it; the reconcile
        then sets the NAME-prefill Deployment's replicas from it (the one writer of Deployments)."""
        body = {"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}}
        return _json(self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, body, _preload_content=False))

    def patch_status(self, namespace: str, name: str, status: dict, resource_version: str) -> dict:
        """Merge-patches status, failing with 409 if the object changed since resource_version."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        return _json(self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE, _preload_content=False))

    # apps deployments and statefulsets, core services, configmaps and serviceaccounts, rbac roles
    # and rolebindings, inference.networking.k8s.io inferencepools, leaderworkerset.x-k8s.io
    # leaderworkersets, networking networkpolicies, policy poddisruptionbudgets: get, patch
    # (server-side apply), delete (what a mode switch or a scale-down leaves behind); core secrets:
    # get; core pods: delete (a multi-node group's restart)
    def _methods(self, kind: str):
        """(read, server-side apply, delete) of a kind, each called as f(name, namespace, ...)."""
        if kind in ("InferencePool", "LeaderWorkerSet"):
            from iterserve.operator.groups import LWS_GROUP, LWS_PLURAL, LWS_VERSION
            from iterserve.operator.routing import (
                INFERENCE_POOL_GROUP,
                INFERENCE_POOL_PLURAL,
                INFERENCE_POOL_VERSION,
            )

            where, plural = (((INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION), INFERENCE_POOL_PLURAL)
                             if kind == "InferencePool" else ((LWS_GROUP, LWS_VERSION), LWS_PLURAL))

            def read(name, namespace, **kw):
                return self.custom.get_namespaced_custom_object(*where, namespace, plural, name, **kw)

            def patch(name, namespace, body, **kw):
                return self.custom.patch_namespaced_custom_object(*where, namespace, plural, name, body, **kw)

            def delete(name, namespace, **kw):
                return self.custom.delete_namespaced_custom_object(*where, namespace, plural, name, **kw)

            return read, patch, delete
        rbac = client.RbacAuthorizationV1Api(self.core.api_client)
        networking = client.NetworkingV1Api(self.core.api_client)
        policy = client.PolicyV1Api(self.core.api_client)
        return {
            "NetworkPolicy": (networking.read_namespaced_network_policy, networking.patch_namespaced_network_policy,
                              networking.delete_namespaced_network_policy),
            "PodDisruptionBudget": (policy.read_namespaced_pod_disruption_budget,
                                    policy.patch_namespaced_pod_disruption_budget,
                                    policy.delete_namespaced_pod_disruption_budget),
            "Deployment": (self.apps.read_namespaced_deployment, self.apps.patch_namespaced_deployment,
                           self.apps.delete_namespaced_deployment),
            "StatefulSet": (self.apps.read_namespaced_stateful_set, self.apps.patch_namespaced_stateful_set,
                            self.apps.delete_namespaced_stateful_set),
            "Pod": (self.core.read_namespaced_pod, None, self.core.delete_namespaced_pod),
            "Service": (self.core.read_namespaced_service, self.core.patch_namespaced_service, None),
            "ConfigMap": (self.core.read_namespaced_config_map, self.core.patch_namespaced_config_map, None),
            "ServiceAccount": (self.core.read_namespaced_service_account, self.core.patch_namespaced_service_account,
                               self.core.delete_namespaced_service_account),
            "Role": (rbac.read_namespaced_role, rbac.patch_namespaced_role, rbac.delete_namespaced_role),
            "RoleBinding": (rbac.read_namespaced_role_binding, rbac.patch_namespaced_role_binding,
                            rbac.delete_namespaced_role_binding),
            "Secret": (self.core.read_namespaced_secret, None, None),
        }[kind]

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        read, _, _ = self._methods(kind)
        try:
            return _json(read(name, namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, manifest: dict, dry_run: bool = False) -> dict:
        _, patch, _ = self._methods(manifest["kind"])
        meta = manifest["metadata"]
        return _json(patch(meta["name"], meta["namespace"], manifest, field_manager=FIELD_MANAGER, force=True,
                           dry_run="All" if dry_run else None, _content_type=APPLY, _preload_content=False))

    def delete(self, obj: dict) -> None:
        """Deletes exactly `obj` (a uid precondition: never a same-named object created since it was
        read); a 404 or 409 means it is gone or replaced already, which is fine."""
        _, _, delete = self._methods(obj["kind"])
        meta = obj["metadata"]
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=meta["uid"]),
                                      propagation_policy="Background")
        try:
            delete(meta["name"], meta["namespace"], body=body, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    # core pods: list
    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        return _json(self.core.list_namespaced_pod(namespace, label_selector=label_selector,
                                                   _preload_content=False))["items"]

    # apps replicasets: list
    def list_replica_sets(self, namespace: str, label_selector: str) -> list[dict]:
        return _json(self.apps.list_namespaced_replica_set(namespace, label_selector=label_selector,
                                                           _preload_content=False))["items"]

    # apps statefulsets: list (multi-node groups, operator/groups.py)
    def list_stateful_sets(self, namespace: str, label_selector: str) -> list[dict]:
        return _json(self.apps.list_namespaced_stateful_set(namespace, label_selector=label_selector,
                                                            _preload_content=False))["items"]

    # apps controllerrevisions: list (the templates a StatefulSet's pods run, for the chain check)
    def list_controller_revisions(self, namespace: str, label_selector: str) -> list[dict]:
        return _json(self.apps.list_namespaced_controller_revision(namespace, label_selector=label_selector,
                                                                   _preload_content=False))["items"]

    # core secrets: get, create
    def create_secret(self, manifest: dict) -> dict:
        return _json(self.core.create_namespaced_secret(
            manifest["metadata"]["namespace"], manifest, field_manager=FIELD_MANAGER, _preload_content=False))

    # core events: create
    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = timestamp(utcnow())
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"],
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": f"{GROUP}/operator",
            "reportingInstance": FIELD_MANAGER,
        }
        self.core.create_namespaced_event(meta["namespace"], event, _preload_content=False)
