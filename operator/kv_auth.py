"""The KV transfer key of a disaggregated InferenceService: Secret `<name>-kv-auth`, data key
`key`, 32 random bytes, created once by the operator and never rewritten (a new key would make
every running engine refuse the others' signed kv_transfer_params until all had restarted), owned
by the InferenceService so it goes with it.

Prefill, decode and router pods mount it read-only at KEY_FILE and get `--kv-auth-key-file
KEY_FILE`: the router signs the kv_transfer_params it sends, prefill engines sign their lease
answers, and engines accept only what carries a valid MAC (engine/kv_transfer/auth.py). No one
else holds the key: the Secret is never listed or watched, and clients never see it.

The builders are key_secret.py's, shared with the router's tenant salt key (router_salt.py).
"""

from __future__ import annotations

from iterserve.operator.key_secret import KEY, KeySecret

KV_AUTH = KeySecret(suffix="kv-auth", mount_dir="/etc/iterserve/kv-auth", flag="--kv-auth-key-file")
KEY_BYTES = KV_AUTH.key_bytes
MOUNT_DIR = KV_AUTH.mount_dir
KEY_FILE = KV_AUTH.key_file
FLAG = KV_AUTH.flag
VOLUME = KV_AUTH.volume_name
secret_name = KV_AUTH.secret_name
build_secret = KV_AUTH.build_secret  # the key is fresh on every call: create it once, never apply it
args = KV_AUTH.args
volume = KV_AUTH.volume
mount = KV_AUTH.mount
__all__ = ["KEY", "KEY_BYTES", "MOUNT_DIR", "KEY_FILE", "FLAG", "VOLUME", "secret_name", "build_secret", "args",
           "volume", "mount"]
