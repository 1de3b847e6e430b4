"""The router's prefill/decode (P/D) path: whether a request's prompt is prefilled on a prefill
replica, and the two request bodies of the wire contract.

In: the client's JSON body, the prompt's token count (exact for token-id prompts; for text, from
the decode replica's /tokenize when the text is long enough to matter), how much of it the
chosen decode replica probably has cached, and the prefill pool's loads. Out: a `PdDecision` (a
prefill replica, or none: prefill on the decode replica, with the reason), then the prefill body
(max_tokens 1, not streamed, `kv_transfer_params.do_remote_decode`) and the decode body (the
client's body plus the prefill answer's `kv_transfer_params` with `do_remote_prefill`).

Trust (engine/kv_transfer/auth.py): engines take kv_transfer_params only with a MAC made with the
InferenceService's KV key. The router signs the do_remote_decode object of the prefill body with
it (`PdPolicy.auth_key`, from --kv-auth-key-file); the prefill engine signs its answer, which the
decode body passes on unchanged. A client's own kv_transfer_params carry no valid MAC, so every
engine refuses them with a 400 naming the field.

`decide` is a pure function, like `picking.pick`: remote prefill only when the uncached prompt is
longer than `threshold_tokens` (moving the KV of a shorter prompt costs more than computing it) and the least-loaded
prefill replica has fewer than `max_prefill_queue` requests (Dynamo's conditional
disaggregation). Anything else goes straight to the decode replica, which prefills locally.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.engine.kv_transfer import auth
from iterserve.router.picking import EndpointLoad, PickPolicy, pick

# PdDecision.reason values (also the `reason` label of the router's P/D decisions counter).
REMOTE = "remote"  # prefilled on a prefill replica, KV pulled by the decode replica
SHORT_PROMPT = "short_prompt"  # uncached prompt at or under the threshold: local prefill
PREFILL_BUSY = "prefill_busy"  # every prefill replica's queue is at max_prefill_queue: local
NO_PREFILL = "no_prefill_ready"  # no routable prefill replica: local
UNSUPPORTED = "unsupported"  # not one prompt to prefill (batched prompts, echo, unreadable body): local
PD_REASONS = (REMOTE, SHORT_PROMPT, PREFILL_BUSY, NO_PREFILL, UNSUPPORTED)

# Why a remote prefill was given up and the decode replica prefilled locally (the `reason` label
# of the fallbacks counter).
FALLBACK_CONNECT = "connect"  # the prefill replica could not be reached, or cut the connection
FALLBACK_TIMEOUT = "timeout"  # no answer within the prefill timeout
FALLBACK_STATUS = "status"  # it answered something other than 200
FALLBACK_NO_PARAMS = "no_kv_transfer_params"  # 200 without kv_transfer_params (not a P/D engine?)
FALLBACK_REASONS = (FALLBACK_CONNECT, FALLBACK_TIMEOUT, FALLBACK_STATUS, FALLBACK_NO_PARAMS)

GENERATION_PATHS = (b"/v1/completions", b"/v1/chat/completions")
# Fields the one-token prefill call must not carry: they contradict max_tokens 1, n 1 or stream false.
PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens", "best_of")
# How long the signed do_remote_decode object stays valid: it is checked when the prefill replica
# takes the request, right after the router sends it; a copy is useless after this.
SIGNED_REQUEST_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class PdPolicy:
    threshold_tokens: int = 512  # remote prefill only for more uncached prompt tokens than this
    max_prefill_queue: int = 4  # ... and only while a prefill replica has fewer requests than this
    auth_key: bytes | None = field(default=None, repr=False)  # the InferenceService's KV key: signs prefill calls


@dataclass(frozen=True, slots=True)
class PdDecision:
    prefill: str | None  # the prefill replica's URL; None: prefill on the decode replica
    reason: str
    uncached_tokens: int | None = None


def decide(uncached_tokens: int | None, prefills: Sequence[EndpointLoad], rng: random.Random,
           policy: PdPolicy = PdPolicy()) -> PdDecision:
    """Where this prompt is prefilled. uncached_tokens None: the request has no single prompt."""
    if uncached_tokens is None:
        return PdDecision(None, UNSUPPORTED)
    if uncached_tokens <= policy.threshold_tokens:
        return PdDecision(None, SHORT_PROMPT, uncached_tokens)
    # The prefill replica's queue is its load (waiting + running as scraped, or this router's
    # in-flight count when that is higher); pick's own saturation is replaced by max_prefill_queue.
    choice = pick(prefills, rng, PickPolicy(max_queue=1 << 30))
    if choice.url is None:
        return PdDecision(None, NO_PREFILL, uncached_tokens)
    if choice.load is not None and choice.load >= policy.max_prefill_queue:
        return PdDecision(None, PREFILL_BUSY, uncached_tokens)
    return PdDecision(choice.url, REMOTE, uncached_tokens)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's one prompt as the router can see it without a tokenizer."""

    token_ids: list[int] | None  # a completions prompt given as token ids
    text: str | None  # a completions prompt as text
    messages: list | None  # a chat request's messages

    @property
    def utf8_len(self) -> int:
        if self.text is not None:
            return len(self.text.encode())
        return len(json.dumps(self.messages, ensure_ascii=False).encode()) if self.messages is not None else 0


def parse_request(path: bytes, body: bytes) -> tuple[dict, Prompt] | None:
    """(the request as a dict, its prompt), or None when the P/D path does not apply: not a
    completions or chat call, not a JSON object, several prompts, or echo (the prompt's own
    logprobs need its logits, which a remote prefill does not send)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("echo") or request.get("prompt_logprobs"):
        return None
    if "kv_transfer_params" in request:  # forwarded as sent: engines refuse it unsigned (400)
        return None
    if path == b"/v1/chat/completions":
        messages = request.get("messages")
        return (request, Prompt(None, None, messages)) if isinstance(messages, list) and messages else None
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return request, Prompt(None, prompt, None)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return request, Prompt(prompt, None, None)
    return None


def surely_short(prompt: Prompt, threshold_tokens: int) -> bool:
    """True when a text prompt cannot have more than threshold_tokens tokens: a token is at least
    one UTF-8 byte, plus a margin for special tokens and the chat template's own text."""
    margin = 16 if prompt.messages is None else 32 + 8 * len(prompt.messages)
    return prompt.utf8_len + margin <= threshold_tokens


def tokenize_body(request: dict, prompt: Prompt) -> bytes:
    """The /tokenize body that counts this prompt as the engine will (the same template, the
    same special tokens)."""
    body: dict = {"model": request["model"]} if isinstance(request.get("model"), str) else {}
    if prompt.messages is not None:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.text
    return json.dumps(body).encode()


def prefill_body(request: dict, policy: PdPolicy, now: float | None = None) -> bytes:
    """The one-token prefill call, its do_remote_decode signed with policy.auth_key (now: unix
    seconds). Without a key it goes unsigned, and the prefill replica refuses it: the router then
    falls back to a local prefill (FALLBACK_STATUS)."""
    body = {k: v for k, v in request.items() if k not in PREFILL_DROPPED}
    kv: dict = {"do_remote_decode": True}
    if policy.auth_key is not None:
        expires_at = (time.time() if now is None else now) + SIGNED_REQUEST_SECONDS
        kv = auth.sign(kv, policy.auth_key, auth.REMOTE_DECODE, expires_at)
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params=kv)
    return json.dumps(body).encode()


def decode_body(request: dict, kv_transfer_params: dict) -> bytes:
    return json.dumps({**request, "kv_transfer_params": {**kv_transfer_params, "do_remote_prefill": True}}).encode()


def kv_params_of(answer: bytes) -> dict | None:
    """The prefill answer's kv_transfer_params, or None if it has none we can pass on."""
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None
