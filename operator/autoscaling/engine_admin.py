"""The engine admin client: the autoscaler's one write to pods. `PATCH /admin/config` sets a
running engine's max_num_seqs (the engine queues it and applies it between steps), with the
admin token from the InferenceService's `<name>-admin` Secret; only pods the autoscaler trusts
(its own Deployment's current pods) are ever sent it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from iterserve.operator.autoscaling.policy import SeqsChange


class AdminError(RuntimeError):
    pass


class EngineAdmin:
    """PATCH /admin/config on one engine, with the admin token."""

    def __init__(self, token: str | None, timeout: float = 5.0):
        self.token = token
        self.timeout = timeout

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def set_max_num_seqs(self, url: str, value: int) -> int:
        """Returns the value the engine reports back; raises AdminError with the engine's reason."""
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                response = await client.patch(f"{url.rstrip('/')}/admin/config", json={"max_num_seqs": value},
                                              headers=self._headers())
        except httpx.HTTPError as error:
            raise AdminError(f"{url}/admin/config: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise AdminError(f"{url}/admin/config: HTTP {response.status_code}: {message}")
        return int(response.json()["max_num_seqs"])

    async def get_max_num_seqs(self, url: str) -> int:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            response = await client.get(f"{url.rstrip('/')}/admin/config", headers=self._headers())
        response.raise_for_status()
        return int(response.json()["max_num_seqs"])


@dataclass(frozen=True)
class SeqsOutcome:
    applied: tuple[SeqsChange, ...]
    failed: tuple[tuple[SeqsChange, str], ...]


async def apply_seqs_changes(admin: EngineAdmin, changes: Sequence[SeqsChange], urls: dict[str, str]) -> SeqsOutcome:
    """Applies each change to its pod's engine, concurrently; a failure on one pod never stops the others."""
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
