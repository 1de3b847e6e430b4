"""The engine admin client: the autoscaler's one write to pods. `PATCH /admin/config` sets a
running engine's max_num_seqs (the engine queues it and applies it between steps), with the
admin token from the InferenceService's `<name>-admin` Secret; only pods the autoscaler trusts
(its own Deployment's current pods) are ever sent it.

The answer comes from a tenant's pod: it is read with a byte cap (ADMIN_MAX_BYTES) and one total
deadline per call (bounded_http.py), and `apply_seqs_changes` bounds all its calls together, so a
pod that trickles its answer cannot hold the autoscaler's tick."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from iterserve.operator.autoscaling.bounded_http import (
    ADMIN_MAX_BYTES,
    Answer,
    BoundedReadError,
    bounded_request,
)
from iterserve.operator.autoscaling.policy import SeqsChange


class AdminError(RuntimeError):
    pass


class EngineAdmin:
    """PATCH /admin/config on one engine, with the admin token; `timeout`: each call's total deadline."""

    def __init__(self, token: str | None, timeout: float = 5.0, max_bytes: int = ADMIN_MAX_BYTES):
        self.token = token
        self.timeout = timeout
        self.max_bytes = max_bytes

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        target = f"{url.rstrip('/')}/admin/config"
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                answer = await bounded_request(client, method, target, json=body, headers=self._headers(),
                                               max_bytes=self.max_bytes, deadline_s=self.timeout)
        except BoundedReadError as error:
            raise AdminError(f"{target}: {error}") from None
        if answer.status != 200:
            raise AdminError(f"{target}: HTTP {answer.status}: {_error_message(answer)}")
        try:
            config = json.loads(answer.body)
            return {"max_num_seqs": int(config["max_num_seqs"])}
        except (ValueError, KeyError, TypeError, RecursionError):
            raise AdminError(f"{target}: answer is not a JSON object with an integer max_num_seqs") from None

    async def set_max_num_seqs(self, url: str, value: int) -> int:
        """Returns the value the engine reports back; raises AdminError with the engine's reason."""
        return (await self._call("PATCH", url, {"max_num_seqs": value}))["max_num_seqs"]

    async def get_max_num_seqs(self, url: str) -> int:
        return (await self._call("GET", url))["max_num_seqs"]


def _error_message(answer: Answer) -> str:
    try:
        return str(json.loads(answer.body)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError, RecursionError):
        return answer.text()[:200]


@dataclass(frozen=True)
class SeqsOutcome:
    applied: tuple[SeqsChange, ...]
    failed: tuple[tuple[SeqsChange, str], ...]


async def apply_seqs_changes(admin: EngineAdmin, changes: Sequence[SeqsChange], urls: dict[str, str]) -> SeqsOutcome:
    """Applies each change to its pod's engine, concurrently; a failure on one pod never stops the
    others. Each call is bounded by the admin's own deadline, so this takes at most about that."""
    async def one(change: SeqsChange):
        url = urls.get(change.pod)
        if url is None:
            return change, "pod has no address"
        try:
            await admin.set_max_num_seqs(url, change.to_max_num_seqs)
        except AdminError as error:
            return change, str(error)
        return change, None

    results = await asyncio.gather(*(one(c) for c in changes))
    return SeqsOutcome(tuple(c for c, e in results if e is None), tuple((c, e) for c, e in results if e is not None))
