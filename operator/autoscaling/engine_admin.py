"""The engine admin client: the autoscaler's one write to pods. `PATCH /admin/config` sets a
running engine's max_num_seqs (the engine queues it and applies it between steps), with the
admin token from the InferenceService's `<name>-admin` Secret; only pods the autoscaler trusts
(its own Deployment's current pods) are ever sent it. `GET /admin/steps` reads an engine's newest
step records (for the online step profile, step_feed.py), with the same token.

The answer comes from a tenant's pod: it is read with a byte cap (ADMIN_MAX_BYTES) and one total
deadline per call (bounded_http.py), and `apply_seqs_changes` bounds all its calls together, so a
pod that trickles its answer cannot hold the autoscaler's tick."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from iterserve.engine.server.protocol import (
    MAX_STEP_RECORDS_BYTES,
    MAX_STEP_RECORDS_PER_CALL,
    MAX_STEP_SEQ,
)
from iterserve.operator.autoscaling.bounded_http import (
    ADMIN_MAX_BYTES,
    Answer,
    BoundedReadError,
    bounded_request,
)
from iterserve.operator.autoscaling.policy import SeqsChange

# A GET /admin/steps answer: the engine caps its records' JSON; room for the envelope around it.
STEPS_MAX_BYTES = MAX_STEP_RECORDS_BYTES + 64 * 1024


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

    async def _answer(self, method: str, target: str, max_bytes: int, **kwargs) -> Answer:
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                answer = await bounded_request(client, method, target, headers=self._headers(),
                                               max_bytes=max_bytes, deadline_s=self.timeout, **kwargs)
        except BoundedReadError as error:
            raise AdminError(f"{target}: {error}") from None
        if answer.status != 200:
            raise AdminError(f"{target}: HTTP {answer.status}: {_error_message(answer)}")
        return answer

    async def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        target = f"{url.rstrip('/')}/admin/config"
        answer = await self._answer(method, target, self.max_bytes, json=body)
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

    async def steps(self, url: str, after: int, limit: int) -> StepPage:
        """The engine's step records after seq `after` (at most `limit`, STEPS_MAX_BYTES, this
        admin's deadline); AdminError when the answer is not a page of them. The records
        themselves are the caller's to check (OnlineProfile drops the malformed ones)."""
        if not 0 <= after <= MAX_STEP_SEQ or not 1 <= limit <= MAX_STEP_RECORDS_PER_CALL:
            raise ValueError(f"after {after} must be in 0..{MAX_STEP_SEQ}, limit {limit} in "
                             f"1..{MAX_STEP_RECORDS_PER_CALL}")
        target = f"{url.rstrip('/')}/admin/steps"
        answer = await self._answer("GET", target, STEPS_MAX_BYTES, params={"after": after, "limit": limit})
        try:
            page = json.loads(answer.body)
            records, next_after, last_seq, now = page["records"], page["next_after"], page["last_seq"], page["now"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise AdminError(f"{target}: answer is not a JSON object with records, next_after, last_seq "
                             "and now") from None
        if not isinstance(records, list) or len(records) > limit:
            raise AdminError(f"{target}: records is not a list of at most {limit}")
        if not all(_seq(v) for v in (next_after, last_seq)) or not after <= next_after <= max(after, last_seq):
            raise AdminError(f"{target}: next_after {next_after!r} and last_seq {last_seq!r} are not seqs from "
                             f"{after} to the newest")
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            raise AdminError(f"{target}: now {now!r} is not a finite number")
        return StepPage(records, next_after, last_seq, float(now))


@dataclass(frozen=True)
class StepPage:
    """A GET /admin/steps answer: `records` unchecked (dicts, as the engine sent them)."""

    records: list
    next_after: int
    last_seq: int
    now: float  # the engine's clock, the records' `time` scale


def _seq(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP_SEQ


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
