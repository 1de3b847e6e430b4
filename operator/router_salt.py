"""The router's tenant salt key: with spec.routing.tenantHeader set (Router mode), every router
replica sets a request's `cache_salt` to HMAC(key, the tenant header's value), so requests share
prefix-cache KV only within a tenant (iterserve/router/body.py). The replicas must agree on the
key, or one tenant's requests would be split across as many caches as there are replicas, and a
restart would empty the tenant's cache: so the key is Secret `<name>-tenant-salt` (32 random
bytes under `key`), created once by the operator, never rewritten, owned by the InferenceService,
and mounted read-only into every router pod with `--tenant-salt-key-file`.

Without tenantHeader there is no Secret and no mount: the router pods are exactly as before, and
the prefix cache is shared by every user of the InferenceService (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from iterserve.operator.key_secret import KeySecret
from iterserve.operator.models import InferenceServiceSpec

TENANT_SALT = KeySecret(suffix="tenant-salt", mount_dir="/etc/iterserve/tenant-salt", flag="--tenant-salt-key-file")
HEADER_FLAG = "--tenant-salt-header"


def wanted(spec: InferenceServiceSpec) -> bool:
    """Whether the InferenceService's router salts by tenant (and so needs the Secret)."""
    return spec.routing.mode == "Router" and spec.routing.tenant_header is not None


def secret_name(name: str) -> str:
    return TENANT_SALT.secret_name(name)


def args(spec: InferenceServiceSpec) -> list[str]:
    return [HEADER_FLAG, spec.routing.tenant_header, *TENANT_SALT.args()] if wanted(spec) else []


def volumes(name: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [TENANT_SALT.volume(name)] if wanted(spec) else []


def mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [TENANT_SALT.mount()] if wanted(spec) else []


build_secret = TENANT_SALT.build_secret  # the key is fresh on every call: create it once, never apply it
