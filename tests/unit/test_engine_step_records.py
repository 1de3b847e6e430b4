"""Every engine keeps its newest step records in a bounded ring (engine/step_log.py), the same
records the step log writes, and serves them on `GET /admin/steps` behind the admin token:
paged after a seq, bounded in count and bytes, its query checked."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from iterserve.engine.config import EngineConfig
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.server import admin
from iterserve.engine.server.app import build_app
from iterserve.engine.server.protocol import MAX_STEP_RECORDS_PER_CALL, StepRecord, StepRecordsPage
from iterserve.engine.server.state import ServerOptions, ServerState
from iterserve.engine.step_log import FIELDS, StepRecords
from tests.server_fixture import running_server

TOKEN = "s3cret-steps"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _values(step: int) -> tuple:
    """One step's figures (FIELDS without seq), recognisable by `step`."""
    return (step, float(step), 0.01, 0.01, 0.0, 0.001, 0.008, 0.001, 0, 1, 1, 10 + step, 10 + step, 0, 1, 0, 1, 0, 0)


def test_the_ring_keeps_the_newest_records_numbered_without_a_gap_and_pages_after_a_seq():
    ring = StepRecords(capacity=5)
    assert ring.after(0, 10) == ([], 0, 0)
    for step in range(1, 9):
        ring.append(_values(step * 10))
    records, first, last = ring.after(0, 10)
    assert (first, last) == (4, 8)  # 8 appended, the newest 5 kept
    assert [r[0] for r in records] == [4, 5, 6, 7, 8] and [r[1] for r in records] == [40, 50, 60, 70, 80]
    assert [r[0] for r in ring.after(5, 2)[0]] == [6, 7]  # after a seq, at most `limit`
    assert ring.after(8, 10)[0] == [] and ring.after(10**6, 10)[0] == []
    assert ring.after(2, 1)[0][0][0] == 4  # the ones that left the ring are skipped
    with pytest.raises(ValueError, match="at least 1"):
        StepRecords(capacity=0)


def test_the_records_fields_are_the_ones_the_api_reference_documents():
    assert tuple(StepRecord.model_fields) == FIELDS
    assert len(_values(1)) == len(FIELDS) - 1


def test_every_step_of_the_embedded_model_is_in_the_ring_as_the_step_log_writes_it(tmp_path):
    from iterserve.engine.llm_engine import LLMEngine
    from tests.unit.engine_helpers import run_to_completion

    log = tmp_path / "steps.jsonl"
    engine = LLMEngine.from_config(EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                                                device="cpu", step_log=str(log)))
    try:
        prompt = engine.tokenizer.encode("The capital of France is a city that many people visit every year")
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=4))
        run_to_completion(engine)
    finally:
        engine.close()
    written = [json.loads(line) for line in log.read_text().splitlines()]
    records, first, last = engine.step_records.after(0, 100)
    in_ring = [dict(zip(FIELDS, r, strict=True)) for r in records]
    assert in_ring == written and (first, last) == (1, len(written))
    assert [r["seq"] for r in in_ring] == list(range(1, len(written) + 1))
    # Chunked prefill in 16-token chunks, then one decode token a step (the first came with the prompt).
    assert [r["prefill_tokens"] for r in in_ring] == [16] * (len(prompt) // 16) + [len(prompt) % 16] * (
        len(prompt) % 16 > 0) + [0, 0, 0]
    assert all(r["cpu_s"] > 0 and r["duration_s"] >= r["model_s"] > 0 for r in in_ring)
    assert in_ring[-1]["context_tokens"] == len(prompt) + 3


def _generate(url: str, count: int, max_tokens: int) -> None:
    def one():
        httpx.post(f"{url}/v1/completions", json={"prompt": "steps", "max_tokens": max_tokens,
                                                  "ignore_eos": True}, timeout=30)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.slow
def test_admin_steps_pages_a_live_servers_records_behind_the_admin_token(tmp_path):
    with running_server(["--fake-model"], env={"ITERSERVE_ADMIN_TOKEN": TOKEN}, log_path=tmp_path / "log") as server:
        steps = f"{server.url}/admin/steps"
        assert httpx.get(steps).status_code == 401
        assert httpx.get(steps, headers={"Authorization": "Bearer nope"}).status_code == 401
        # The token is checked before the query: a caller without it learns nothing from a 400.
        assert httpx.get(steps, params={"limit": 0}).status_code == 401
        empty = httpx.get(steps, headers=AUTH).json()
        assert (empty["records"], empty["next_after"], empty["last_seq"], empty["capacity"]) == ([], 0, 0, 4096)

        _generate(server.url, 3, 20)
        page = StepRecordsPage.model_validate(httpx.get(steps, params={"limit": 10}, headers=AUTH).json())
        assert [r.seq for r in page.records] == list(range(1, 11)) and page.next_after == 10
        assert page.first_seq == 1 and page.last_seq >= 20 and page.missed == 0
        assert page.records[0].prefill_tokens > 0 and sum(r.decode_tokens for r in page.records) > 0
        assert all(0 <= page.now - r.time < 30 for r in page.records)  # the engine's clock, now included
        rest = httpx.get(steps, params={"after": page.next_after, "limit": MAX_STEP_RECORDS_PER_CALL},
                         headers=AUTH).json()
        assert [r["seq"] for r in rest["records"]] == list(range(11, rest["last_seq"] + 1))
        done = httpx.get(steps, params={"after": rest["next_after"]}, headers=AUTH).json()
        assert done["records"] == [] and done["next_after"] == rest["next_after"]

        for query, param in [({"limit": 0}, "limit"), ({"limit": MAX_STEP_RECORDS_PER_CALL + 1}, "limit"),
                             ({"after": -1}, "after"), ({"after": "x"}, "after"), ({"after": 2**64}, "after"),
                             ({"newest": 1}, "newest")]:
            bad = httpx.get(steps, params=query, headers=AUTH)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (query, bad.text)


def test_an_answer_stops_at_the_byte_cap_and_says_where_to_go_on(monkeypatch):
    state = ServerState(ServerOptions(EngineConfig(model="fake"), "fake"))
    app = build_app(state)

    async def run():
        await state.load()
        ring = state.engine.engine.step_records
        for step in range(1, 301):
            ring.append(_values(step))
        one = len(json.dumps(dict(zip(FIELDS, (1, *_values(1)), strict=True)), separators=(",", ":"))) + 1
        monkeypatch.setattr(admin, "MAX_STEP_RECORDS_BYTES", 10 * one + 5)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                first = (await client.get("/admin/steps", params={"limit": 1000})).json()
                then = (await client.get("/admin/steps", params={"after": first["next_after"]})).json()
                # A reader that fell behind a small ring is told how many records it missed.
                state.engine.engine.step_records = small = StepRecords(capacity=5)
                for step in range(1, 9):
                    small.append(_values(step))
                behind = (await client.get("/admin/steps", params={"after": 1})).json()
        finally:
            state.close()
        return first, then, behind

    first, then, behind = asyncio.run(run())
    assert [r["seq"] for r in first["records"]] == list(range(1, 11)) and first["next_after"] == 10
    assert then["records"][0]["seq"] == 11
    assert (behind["missed"], behind["first_seq"], [r["seq"] for r in behind["records"]]) == (2, 4, [4, 5, 6, 7, 8])
