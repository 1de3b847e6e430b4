"""A random key the operator keeps for an InferenceService's pods: Secret `<name>-<suffix>`, data
key `key`, fresh random text (key_bytes random bytes, URL-safe base64), created once and never rewritten, owned by the InferenceService so
it goes with it. The pods that need it mount it read-only and get `<flag> <file>`; nothing else
holds it: the operator never lists, watches or logs Secrets' data, and clients never see it.

Two use it: the KV transfer key (kv_auth.py) and the router's tenant salt key (router_salt.py).
Pure builders; reconcile.py creates the Secret, resources.py and routing.py add the volume.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

KEY = "key"


@dataclass(frozen=True)
class KeySecret:
    suffix: str  # Secret <name>-<suffix>; also the volume's name
    mount_dir: str
    flag: str  # the command-line flag that names the key file
    key_bytes: int = 32

    @property
    def key_file(self) -> str:
        return f"{self.mount_dir}/{KEY}"

    @property
    def volume_name(self) -> str:
        return self.suffix

    def secret_name(self, name: str) -> str:
        return f"{name}-{self.suffix}"

    def build_secret(self, owner) -> dict[str, Any]:
        """`owner`: resources.Owner. The key is fresh on every call: create it once, never apply it."""
        from iterserve.operator.resources import (  # resources imports the users of this module
            common_labels,
            owner_reference,
        )

        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": self.secret_name(owner.name), "namespace": owner.namespace,
                         "labels": common_labels(owner.name), "ownerReferences": [owner_reference(owner)]},
            # Text, not raw bytes: the readers strip surrounding whitespace (a hand-written key file
            # ends in a newline), which would cut a raw key that happens to start or end with one.
            "data": {KEY: base64.b64encode(secrets.token_urlsafe(self.key_bytes).encode()).decode()},
        }

    def args(self) -> list[str]:
        return [self.flag, self.key_file]

    def volume(self, name: str) -> dict[str, Any]:
        # 0444: the pods run as a non-root user without fsGroup (the router), and the mount is the
        # container's own; only the one key is projected.
        return {"name": self.volume_name, "secret": {"secretName": self.secret_name(name), "defaultMode": 0o444,
                                                     "items": [{"key": KEY, "path": KEY}]}}

    def mount(self) -> dict[str, Any]:
        return {"name": self.volume_name, "mountPath": self.mount_dir, "readOnly": True}
