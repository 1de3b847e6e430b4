"""What the router changes in a client's JSON body before any replica sees it.

In: a POST body to /v1/... and the tenant the request came from (or None). Out: the body to
forward, or BadBody.

- `kv_transfer_params` is removed from every body: only the router's own P/D path may send it
  (a client's own would make an engine dial an address of the client's choosing, or pin KV).
- With a tenant (`--tenant-salt-header`), completions and chat bodies get `cache_salt` set to a
  keyed hash of the tenant id, replacing any the client sent: requests share prefix-cache KV
  only within a tenant, so one tenant's cache hits and timing say nothing of another's prompts.

The body is parsed, never searched for the field name: JSON can spell a key with escapes
(`"kv\\u005ftransfer_params"`), which the engine's parser would read as the real key. A POST
body that is not a JSON object is refused here, so no replica can parse it differently.
"""

from __future__ import annotations

import hashlib
import hmac
import json

SYSTEM_ONLY = "kv_transfer_params"
SALTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # the engine takes cache_salt on these only


class BadBody(ValueError):
    """The body is not a JSON object."""


def tenant_salt(key: bytes, tenant: str) -> str:
    """The cache_salt of a tenant: HMAC-SHA256 keyed by the router's salt key, so a tenant that
    learns its own salt cannot compute another's."""
    return hmac.new(key, tenant.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def rewrite(path: str, body: bytes, salt: str | None) -> tuple[bytes, dict]:
    """(the body to forward, the parsed request as forwarded). Re-encodes only when it changed,
    so an ordinary body goes out byte for byte."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadBody(f"the body is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise BadBody("the body must be a JSON object")
    changed = SYSTEM_ONLY in request
    request.pop(SYSTEM_ONLY, None)
    if salt is not None and path in SALTED_PATHS and request.get("cache_salt") != salt:
        request["cache_salt"] = salt
        changed = True
    return (json.dumps(request).encode() if changed else body), request
