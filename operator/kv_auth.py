"""The KV transfer key of a disaggregated InferenceService: Secret `<name>-kv-auth`, data key
`key`, 32 random bytes, created once by the operator and never rewritten (a new key would make
every running engine refuse the others' signed kv_transfer_params until all had restarted), owned
by the InferenceService so it goes with it.

Prefill, decode and router pods mount it read-only at KEY_FILE and get `--kv-auth-key-file
KEY_FILE`: the router signs the kv_transfer_params it sends, prefill engines sign their lease
answers, and engines accept only what carries a valid MAC (engine/kv_transfer/auth.py). No one
else holds the key: the Secret is never listed or watched, and clients never see it.

Pure builders; reconcile.py creates the Secret, resources.py and routing.py add the volume.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

KEY = "key"
KEY_BYTES = 32
MOUNT_DIR = "/etc/iterserve/kv-auth"
KEY_FILE = f"{MOUNT_DIR}/{KEY}"
FLAG = "--kv-auth-key-file"
VOLUME = "kv-auth"


def secret_name(name: str) -> str:
    return f"{name}-kv-auth"


def build_secret(owner) -> dict[str, Any]:
    """`owner`: resources.Owner. The key is fresh on every call: create it once, never apply it."""
    from iterserve.operator.resources import (  # resources imports this module
        common_labels,
        owner_reference,
    )

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret_name(owner.name), "namespace": owner.namespace,
                     "labels": common_labels(owner.name), "ownerReferences": [owner_reference(owner)]},
        "data": {KEY: base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()},
    }


def args() -> list[str]:
    return [FLAG, KEY_FILE]


def volume(name: str) -> dict[str, Any]:
    # 0444: the pods run as a non-root user without fsGroup (the router), and the mount is the
    # container's own; only the one key is projected.
    return {"name": VOLUME, "secret": {"secretName": secret_name(name), "defaultMode": 0o444,
                                       "items": [{"key": KEY, "path": KEY}]}}


def mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}
