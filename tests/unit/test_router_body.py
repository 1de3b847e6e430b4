"""What the router changes in a client's body (router/body.py)."""

from __future__ import annotations

import json

import pytest

from iterserve.router.body import BadBody, rewrite, tenant_salt


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}',
    b'{"prompt": "x", "kv\\u005ftransfer_params": {"do_remote_prefill": true}}',  # the same key, escaped
    b'{"prompt": "x", "kv_transfer_params": null}',
    b'{"prompt": "x", "kv_transfer_params": {}, "kv_transfer_params": {"do_remote_prefill": true}}',
])
def test_client_kv_transfer_params_are_removed_however_spelled(body):
    sent, request = rewrite("/v1/completions", body, None)
    assert json.loads(sent) == {"prompt": "x"} and request == {"prompt": "x"}


def test_an_ordinary_body_goes_out_byte_for_byte():
    body = b'{"prompt":  "x",\n "max_tokens": 2}'
    assert rewrite("/v1/completions", body, None)[0] is body


def test_the_tenant_salt_replaces_the_clients_on_generation_paths_only():
    salt = tenant_salt(b"k" * 32, "a")
    assert salt != tenant_salt(b"k" * 32, "b") and salt != tenant_salt(b"j" * 32, "a")
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert json.loads(rewrite(path, b'{"cache_salt": "mine"}', salt)[0]) == {"cache_salt": salt}
    assert json.loads(rewrite("/v1/embeddings", b'{"input": "x"}', salt)[0]) == {"input": "x"}


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b'"text"', b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_refused(body):
    with pytest.raises(BadBody):
        rewrite("/v1/completions", body, None)
