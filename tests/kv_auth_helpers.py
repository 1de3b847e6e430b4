"""The KV key of tests that run prefill and decode engines (engine/kv_transfer/auth.py): one file
per test process, and the router's side of the signing for tests that play the router."""

from __future__ import annotations

import atexit
import os
import tempfile
import time
from functools import cache

from iterserve.engine.kv_transfer import auth

KEY = b"a-test-kv-key-of-32-bytes-length"
OTHER_KEY = b"another-inference-service-key-xx"


@cache
def key_file(key: bytes = KEY) -> str:
    """A file holding key, removed when the test process exits."""
    handle, path = tempfile.mkstemp(prefix="kv-auth-", suffix=".key")
    with os.fdopen(handle, "wb") as out:
        out.write(key + b"\n")  # a trailing newline, as `kubectl create secret --from-file` keeps it
    atexit.register(os.unlink, path)
    return path


def remote_decode(key: bytes = KEY, ttl: float = 30.0) -> dict:
    """The kv_transfer_params of a prefill call, signed as the router signs them."""
    return auth.sign({"do_remote_decode": True}, key, auth.REMOTE_DECODE, time.time() + ttl)


def sign_lease(params: dict, key: bytes = KEY, ttl: float = 60.0) -> dict:
    """params (a lease answer, altered or made up) signed as a prefill engine holding key would."""
    unsigned = {k: v for k, v in params.items() if k not in (auth.MAC_FIELD, auth.EXPIRES_FIELD)}
    return auth.sign(unsigned, key, auth.REMOTE_PREFILL, time.time() + ttl)


def run_engine(engine, timeout: float) -> dict:
    """Step until nothing is unfinished (KV pulls run on their own threads); finished outputs by id."""
    finished = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if engine.last_step_was_idle:
            time.sleep(0.002)
        assert time.monotonic() < deadline, "engine did not finish"
    return finished
