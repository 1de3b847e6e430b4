"""Signing and checking `kv_transfer_params` with the per-InferenceService KV key.

Engines trust a `kv_transfer_params` object only when it carries a MAC made with the key every
engine and router of one InferenceService reads from `--kv-auth-key-file` (the operator mounts
Secret `<name>-kv-auth` there). Clients never hold the key, so a client cannot make an engine
lease KV, dial a host:port of its choosing, or file KV it chose.

    mac = HMAC-SHA256(key, purpose + "\\n" + canonical JSON of the params without "mac")

The canonical JSON sorts keys, has no spaces and escapes non-ASCII, so the signer and the checker
hash the same bytes whatever their JSON libraries do. `purpose` separates the two signed objects
(the router's do_remote_decode request and the prefill engine's lease answer), so one can never be
replayed as the other. `expires_at` (unix seconds: the two sides are different machines, whose
monotonic clocks cannot be compared) bounds how long a copied object stays useful.

No I/O beyond reading the key file, no torch: the router imports this module too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat

from iterserve.engine.config import ConfigError

MAC_FIELD = "mac"
EXPIRES_FIELD = "expires_at"
REMOTE_DECODE = "remote-decode"  # the router -> a prefill engine: run this prompt and lease its KV
REMOTE_PREFILL = "remote-prefill"  # a prefill engine's lease answer, passed on to a decode engine
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


class KVAuthError(ValueError):
    """A kv_transfer_params object is not signed, badly signed or expired; the message says which."""


def load_key(path: str, flag: str = "--kv-auth-key-file") -> bytes:
    """The key in the file at path (surrounding whitespace dropped: a Secret written with a trailing
    newline is the same key). Raises ConfigError naming the flag."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"{flag} {path}: not a regular file of at most {MAX_KEY_FILE_BYTES} bytes")
        with open(path, "rb") as handle:
            key = handle.read(MAX_KEY_FILE_BYTES + 1).strip()
    except OSError as error:
        raise ConfigError(f"{flag} {path}: cannot read the KV auth key ({error.strerror}); mount the "
                         "InferenceService's <name>-kv-auth Secret there or point the flag at the key") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{flag} {path}: the key has {len(key)} bytes, at least {MIN_KEY_BYTES} are needed "
                         "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return key


def _mac(key: bytes, purpose: str, params: dict) -> str:
    body = {k: v for k, v in params.items() if k != MAC_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hmac.new(key, purpose.encode() + b"\n" + canonical.encode(), hashlib.sha256).hexdigest()


def sign(params: dict, key: bytes, purpose: str, expires_at: float) -> dict:
    """params with expires_at and mac added (a new dict)."""
    signed = {**params, EXPIRES_FIELD: round(float(expires_at), 3)}
    signed[MAC_FIELD] = _mac(key, purpose, signed)
    return signed


def verify(params: dict, key: bytes, purpose: str, now: float) -> None:
    """Raises KVAuthError unless params carry a valid, unexpired mac for purpose."""
    mac = params.get(MAC_FIELD)
    if not isinstance(mac, str):
        raise KVAuthError(f"{MAC_FIELD} is missing: kv_transfer_params are accepted only as signed by this "
                          "InferenceService's router or prefill engines, never from clients")
    expires_at = params.get(EXPIRES_FIELD)
    if not isinstance(expires_at, (int, float)) or isinstance(expires_at, bool):
        raise KVAuthError(f"{EXPIRES_FIELD} is missing or not a number")
    try:
        expected = _mac(key, purpose, params)
    except (TypeError, ValueError):
        raise KVAuthError("the object cannot be signed (not plain JSON)") from None
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        raise KVAuthError(f"{MAC_FIELD} does not match: not signed with this InferenceService's KV key "
                          "(--kv-auth-key-file differs between replicas, or the object was altered)")
    if expires_at <= now:
        raise KVAuthError(f"expired {now - expires_at:.1f} s ago ({EXPIRES_FIELD} {expires_at})")
