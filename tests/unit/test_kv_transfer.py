"""Prefill/decode KV transfer, engine side (engine/kv_transfer): the wire format, the handshake,
leases, the decode engine's waiting-for-KV state and its failure policies. Engines run the real
scheduler on the fake model, whose KV slots hold the token ids computed there, so a pull moves
bytes the decode side checks against its prompt; transfers go over real loopback TCP."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer
from iterserve.engine.kv_transfer import auth, wire
from iterserve.engine.kv_transfer import params as params_module
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.transport import LeaseRead, PullRequest, TcpTransport
from iterserve.engine.kv_transfer.wire import FrameError, KVTransferError
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.sequence import Sequence, SequenceStatus
from tests.kv_auth_helpers import KEY, OTHER_KEY, key_file, remote_decode, run_engine, sign_lease
from tests.unit.engine_helpers import ManualClock

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFILL_CALL = SamplingParams(temperature=0, max_tokens=1)
BLOCK = 16


def make_engine(role: str = "both", num_blocks: int = 64, clock=time.monotonic, **options) -> LLMEngine:
    options.setdefault("max_model_len", 256)
    if role != "both":
        options.setdefault("kv_auth_key_file", key_file())
    config = EngineConfig(model="fake", role=role, block_size=BLOCK, **options).resolve()
    return LLMEngine(config, FakeExecutor(num_blocks, 0, block_size=BLOCK), FakeTokenizer(), clock)


def run(engine: LLMEngine, timeout: float = 10.0) -> dict:
    return run_engine(engine, timeout)


def prefill(engine: LLMEngine, prompt: str, request_id: str = "p") -> dict:
    engine.add_request(prompt, PREFILL_CALL, request_id=request_id, kv_transfer_params=remote_decode())
    out = run(engine)[request_id]
    assert out.error is None
    return out.kv_transfer_params


def reference(prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    engine = make_engine()
    engine.add_request(prompt, params, request_id="ref")
    return run(engine)["ref"].outputs[0].token_ids


def assert_baseline(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.collect_kv_leases()
        manager = engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
        assert manager.gpu.num_used == 0
        assert engine.stats().num_pinned_blocks == 0 and engine.stats().num_waiting_for_kv == 0


@pytest.fixture
def pair():
    prefill_engine, decode_engine = make_engine("prefill"), make_engine("decode")
    prefill_engine.start_kv_transfer()
    yield prefill_engine, decode_engine
    prefill_engine.close()
    decode_engine.close()


@contextmanager
def black_hole():
    """A listener that accepts connections and never answers (a hung prefill engine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()


def remote(params: dict, **changes) -> dict:
    return {**params, **changes, "do_remote_prefill": True}


def fake_params(port: int, num_tokens: int, engine: LLMEngine, **changes) -> dict:
    """A lease answer from a made-up prefill engine at port, signed with the test key."""
    blocks = -(-num_tokens // BLOCK)
    return remote(sign_lease({"transfer_id": "t", "engine_id": "e", "host": "127.0.0.1", "port": port,
                              "block_ids": list(range(blocks)), "num_tokens": num_tokens, "block_size": BLOCK,
                              "compat_hash": engine.kv_connector.compat_hash, "lease_expires_at": time.time() + 60,
                              "lease_secret": "s", **changes}))


# -- the wire -------------------------------------------------------------------------------------
def _socketpair_with(data: bytes):
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    return b


def test_frames_round_trip_and_corruption_is_refused():
    a, b = socket.socketpair()
    wire.send_frame(a, wire.LAYER, b"key-bytes", b"value-bytes")
    assert wire.recv_frame(b, [wire.LAYER], 20) == (wire.LAYER, bytearray(b"key-bytesvalue-bytes"))
    a.close()
    b.close()

    good = wire.frame_header(wire.LAYER, [b"payload"]) + b"payload"
    with pytest.raises(FrameError, match="checksum mismatch"):
        wire.recv_frame(_socketpair_with(good[:-1] + b"X"), [wire.LAYER], 7)
    with pytest.raises(FrameError, match="bad frame magic"):
        wire.recv_frame(_socketpair_with(b"HTTP" + good[4:]), [wire.LAYER], 7)
    other_version = wire.HEADER.pack(wire.MAGIC, wire.VERSION + 1, wire.LAYER, 7, 0) + b"payload"
    with pytest.raises(FrameError, match=f"version {wire.VERSION + 1}, this engine speaks {wire.VERSION}"):
        wire.recv_frame(_socketpair_with(other_version), [wire.LAYER], 7)
    with pytest.raises(FrameError, match="closed the connection after 3 of 7 bytes"):
        wire.recv_frame(_socketpair_with(good[:-4]), [wire.LAYER], 7)
    with pytest.raises(FrameError, match="expected PULL, got LAYER"):
        wire.recv_frame(_socketpair_with(good), [wire.PULL])


LAYOUT = KVLayout(model="m/none", dtype="float32", num_layers=30, num_kv_heads=3, head_size=64, block_size=16,
                  itemsize=4)


@pytest.mark.parametrize("change", [{"model": "other/none"}, {"dtype": "bfloat16", "itemsize": 2}, {"num_layers": 24},
                                    {"num_kv_heads": 4}, {"head_size": 128}, {"block_size": 32}])
def test_handshake_refuses_a_different_layout_naming_the_field(change):
    class Source:
        layout, engine_id = LAYOUT, "prefill"

        def open_read(self, *args):
            raise AssertionError("a refused peer must not read")

    transport = TcpTransport()
    port = transport.listen(Source(), "127.0.0.1", 0)
    try:
        theirs = dataclasses.replace(LAYOUT, **change)
        with pytest.raises(KVTransferError, match="REFUSED.*KV layouts differ") as refused:
            transport.pull(PullRequest("127.0.0.1", port, "t", "s", 0, 1, time.monotonic() + 5), theirs, "decode")
        for name in change:
            assert f"{name}: " in str(refused.value)
        assert theirs.compat_hash != LAYOUT.compat_hash
    finally:
        transport.close()


# -- prefill -> decode ----------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 1, 150])
def test_decode_after_a_pull_equals_local_greedy_and_frees_both_sides(pair, length):
    prefill_engine, decode_engine = pair
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(length))
    params = prefill(prefill_engine, prompt)
    assert params["num_tokens"] == length and len(params["block_ids"]) == -(-length // BLOCK)
    assert params["compat_hash"] == decode_engine.kv_connector.compat_hash
    assert prefill_engine.stats().num_pinned_blocks == len(params["block_ids"])
    decode_engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=remote(params))
    out = run(decode_engine)["d"]
    assert out.error is None
    assert out.outputs[0].token_ids == reference(prompt)
    stats = decode_engine.stats()
    assert (stats.kv_pulls_ok, stats.kv_pulls_failed) == (1, 0)
    # Decode released the lease over the transfer connection; the prefill engine frees it next step.
    deadline = time.monotonic() + 5
    while prefill_engine.kv_connector.num_leases and time.monotonic() < deadline:
        prefill_engine.collect_kv_leases()
        time.sleep(0.005)
    assert prefill_engine.kv_connector.counts.leases_released == 1
    assert_baseline(prefill_engine, decode_engine)


def test_pulled_bytes_are_checked_against_the_prompt(pair):
    """The fake KV is token ids: a pull of another prompt's blocks (same length) fails the request."""
    prefill_engine, decode_engine = pair
    params = prefill(prefill_engine, "x" * 40)
    decode_engine.add_request("y" * 40, GREEDY, request_id="d", kv_transfer_params=remote(params))
    out = run(decode_engine)["d"]
    assert out.error == "the pulled KV does not match the prompt"
    assert_baseline(decode_engine)
    prefill_engine.kv_connector.release_all()
    assert_baseline(prefill_engine)


def test_lease_expiry_frees_pinned_blocks_and_a_late_pull_recomputes():
    clock = ManualClock()
    prefill_engine = make_engine("prefill", clock=clock, kv_lease_seconds=5)
    decode_engine = make_engine("decode")
    prefill_engine.start_kv_transfer()
    try:
        prompt = "the lease runs out " * 3
        params = prefill(prefill_engine, prompt)
        pinned = len(params["block_ids"])
        assert prefill_engine.block_manager.num_free_blocks == 64 - pinned
        clock.now += 4.9
        assert prefill_engine.collect_kv_leases() == 0
        clock.now += 0.2
        assert prefill_engine.collect_kv_leases() == pinned
        assert prefill_engine.stats().kv_leases_expired == 1
        assert_baseline(prefill_engine)
        # The decode engine learns only at pull time: the listener answers ERROR, and it recomputes.
        decode_engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=remote(params))
        out = run(decode_engine)["d"]
        assert out.error is None and out.outputs[0].token_ids == reference(prompt)
        assert decode_engine.stats().kv_pulls_failed == 1
        assert_baseline(decode_engine)
    finally:
        prefill_engine.close()
        decode_engine.close()


def test_prefill_host_gone_recomputes_or_fails_per_policy():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # closed again: nothing listens there
    prompt = "nobody is home " * 4
    for policy in ("recompute", "fail"):
        engine = make_engine("decode", kv_failure_policy=policy)
        engine.add_request(prompt, GREEDY, request_id="d",
                           kv_transfer_params=fake_params(dead_port, len(prompt), engine))
        out = run(engine)["d"]
        if policy == "recompute":
            assert out.error is None and out.outputs[0].token_ids == reference(prompt)
        else:
            assert out.outputs[0].finish_reason == "error"
            assert "pulling the prompt's KV from the prefill engine failed" in out.error
            assert "cannot connect" in out.error
        assert engine.stats().kv_pulls_failed == 1
        assert_baseline(engine)


def test_a_hung_prefill_engine_times_out_then_recomputes():
    prompt = "hung " * 10
    with black_hole() as port:
        engine = make_engine("decode", kv_transfer_timeout=0.5)
        started = time.monotonic()
        engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=fake_params(port, len(prompt), engine))
        out = run(engine)["d"]
        assert time.monotonic() - started < 5
        assert out.error is None and out.outputs[0].token_ids == reference(prompt)
        assert engine.stats().kv_pulls_failed == 1
        assert_baseline(engine)


def test_incompatible_params_fail_fast_and_recompute(pair):
    prefill_engine, decode_engine = pair
    prompt = "z" * 33
    params = prefill(prefill_engine, prompt)
    # Signed, as a prefill engine of another model would sign its lease.
    decode_engine.add_request(prompt, GREEDY, request_id="d",
                              kv_transfer_params=remote(sign_lease({**params, "compat_hash": "0" * 16})))
    out = run(decode_engine)["d"]
    assert out.error is None and out.outputs[0].token_ids == reference(prompt)
    assert decode_engine.stats().kv_pulls_failed == 1
    prefill_engine.kv_connector.release_all()
    assert_baseline(prefill_engine, decode_engine)


# -- the scheduler's waiting-for-KV state ---------------------------------------------------------
def test_waiting_for_kv_holds_blocks_but_no_token_budget():
    with black_hole() as port:
        engine = make_engine("decode", max_num_batched_tokens=64, kv_transfer_timeout=60)
        engine.add_request("w" * 40, GREEDY, request_id="remote", kv_transfer_params=fake_params(port, 40, engine))
        engine.add_request("a" * 100, GREEDY, request_id="local")
        engine.step()
        remote_seq = engine._sequences["remote"]
        assert remote_seq.status is SequenceStatus.WAITING_FOR_KV
        assert len(remote_seq.block_table) == 3
        assert engine.stats().num_waiting_for_kv == 1
        assert (engine.stats().num_waiting, engine.stats().num_running) == (1, 1)  # counted waiting, as vLLM does
        # The local prompt got the whole 64-token budget though the remote one was admitted first.
        assert engine._sequences["local"].num_computed_tokens == 64
        engine.abort_request("remote")
        run(engine)
        assert_baseline(engine)


def test_waiting_for_kv_is_never_preempted_and_abort_frees_it():
    with black_hole() as port:
        # 16 blocks of 16: two growing local requests must preempt; the remote one holds 4 blocks.
        engine = make_engine("decode", num_blocks=16, max_model_len=128, kv_transfer_timeout=60, watermark=0.0)
        engine.add_request("r" * 64, GREEDY, request_id="remote", kv_transfer_params=fake_params(port, 64, engine))
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        engine.add_request("a" * 40, long, request_id="a")
        engine.add_request("b" * 40, long, request_id="b")
        remote_seq = engine._sequences["remote"]
        done = {}
        while "a" not in done or "b" not in done:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            assert remote_seq.status is SequenceStatus.WAITING_FOR_KV and len(remote_seq.block_table) == 4
        assert engine.stats().num_preemptions > 0  # the pool was short, and the others paid for it
        assert remote_seq.num_preemptions == 0
        engine.abort_request("remote")
        aborted = run(engine)
        assert aborted["remote"].outputs[0].finish_reason == "abort"
        assert_baseline(engine)


def test_abort_mid_transfer_frees_both_engines(pair):
    """The prefill engine's read is held in flight; decode aborts: its blocks go back at once, and the
    lease it releases is freed only once the read in flight has ended."""
    prefill_engine, decode_engine = pair
    connector = prefill_engine.kv_connector
    reading, resume = threading.Event(), threading.Event()
    original = connector._read_layers

    def slow_read(block_ids):
        reading.set()
        resume.wait(10)
        yield from original(block_ids)

    connector._read_layers = slow_read
    prompt = "abort me " * 6
    params = prefill(prefill_engine, prompt)
    decode_engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=remote(params))
    decode_engine.step()
    assert reading.wait(5)
    decode_engine.abort_request("d")
    out = run(decode_engine)["d"]
    assert out.outputs[0].finish_reason == "abort"
    assert_baseline(decode_engine)
    deadline = time.monotonic() + 5
    while not connector._leases[params["transfer_id"]].released:  # the abort's RELEASE arrived
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert prefill_engine.collect_kv_leases() == 0  # still being read
    assert connector.num_pinned_blocks == len(params["block_ids"])
    resume.set()
    while connector.num_leases:
        assert time.monotonic() < deadline
        prefill_engine.collect_kv_leases()
        time.sleep(0.01)
    assert_baseline(prefill_engine)
    # And the pair still works after the abort.
    params = prefill(prefill_engine, prompt)
    decode_engine.add_request(prompt, GREEDY, request_id="again", kv_transfer_params=remote(params))
    assert run(decode_engine)["again"].outputs[0].token_ids == reference(prompt)


# -- requests ------------------------------------------------------------------------------------
def test_roles_refuse_the_other_half_and_bad_params_name_the_field():
    prefill_engine, decode_engine = make_engine("prefill"), make_engine("decode")
    with pytest.raises(InvalidRequestError, match="runs --role decode") as error:
        decode_engine.add_request("x", PREFILL_CALL, kv_transfer_params=remote_decode())
    assert error.value.param == "kv_transfer_params.do_remote_decode"
    with pytest.raises(InvalidRequestError, match="no KV transfer listener"):  # not listening yet
        prefill_engine.add_request("x", PREFILL_CALL, kv_transfer_params=remote_decode())
    good = fake_params(1, 1, prefill_engine)
    with pytest.raises(InvalidRequestError, match="runs --role prefill"):
        prefill_engine.add_request("x", GREEDY, kv_transfer_params=good)
    for name in ("transfer_id", "host", "port", "block_ids", "num_tokens", "compat_hash", "lease_secret"):
        with pytest.raises(InvalidRequestError) as error:
            decode_engine.add_request("x", GREEDY, kv_transfer_params={k: v for k, v in good.items() if k != name})
        assert error.value.param == f"kv_transfer_params.{name}"
    with pytest.raises(InvalidRequestError, match="block_ids"):
        decode_engine.add_request("x", GREEDY, kv_transfer_params={**good, "block_ids": [-1]})
    with pytest.raises(InvalidRequestError, match="prompt logprobs"):
        decode_engine.add_request("x", SamplingParams(max_tokens=1, prompt_logprobs=0), kv_transfer_params=good)
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        decode_engine.add_request("x", GREEDY, kv_transfer_params={**good, "do_remote_decode": True})
    # Neither flag: an ordinary request (vLLM ignores such an object too).
    decode_engine.add_request("x", GREEDY, request_id="plain", kv_transfer_params={"do_remote_decode": False})
    assert run(decode_engine)["plain"].outputs[0].token_ids == reference("x")
    assert not prefill_engine.has_unfinished_requests()


def test_decode_pulls_only_what_its_prefix_cache_lacks(pair):
    """A decode engine that has served the prompt's first blocks before shares them from its prefix
    cache and pulls only the rest of the lease."""
    prefill_engine, _ = pair
    decode_engine = make_engine("decode", enable_prefix_caching=True)
    shared = "a conversation so far, " * 3  # 69 tokens: 4 full blocks cached after the first turn
    decode_engine.add_request(shared, GREEDY, request_id="turn1")
    run(decode_engine)
    prompt = shared + "and the next question?"  # 91 tokens, 6 blocks
    params = prefill(prefill_engine, prompt)
    decode_engine.add_request(prompt, GREEDY, request_id="turn2", kv_transfer_params=remote(params))
    out = run(decode_engine)["turn2"]
    assert out.error is None and out.outputs[0].token_ids == reference(prompt)
    counts = decode_engine.kv_connector.counts
    assert (counts.blocks_from_cache, counts.blocks_pulled) == (4, 2)
    deadline = time.monotonic() + 5
    while prefill_engine.kv_connector.num_leases:
        assert time.monotonic() < deadline
        prefill_engine.collect_kv_leases()
        time.sleep(0.005)
    assert_baseline(prefill_engine, decode_engine)


@pytest.mark.slow
def test_kv_transfer_bench_quick_runs(tmp_path):
    """bench/cluster/kv_transfer.py --quick (no model): the pulled KV is checked bit for bit inside it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "kv.json"
    result = subprocess.run([sys.executable, "-m", "bench.cluster.kv_transfer", "--quick", "--lengths", "17,64",
                             "--repeats", "1", "--json", str(out)], cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["tokens"]) for r in rows] == [("float32", 17), ("float32", 64), ("bfloat16", 17),
                                                          ("bfloat16", 64)]
    assert rows[1]["bytes_per_token"] >= 46080 and rows[3]["bytes_per_token"] >= 23040


def test_a_decode_engine_that_dies_mid_read_leaves_the_lease_to_expire():
    """A puller that vanishes after the first layer frame (killed): the prefill engine's read ends,
    nothing is released, and the lease's blocks are freed at expiry."""
    clock = ManualClock()
    engine = make_engine("prefill", clock=clock, kv_lease_seconds=30)
    port = engine.start_kv_transfer()
    try:
        params = prefill(engine, "killed halfway " * 8)
        layout = engine.kv_connector.layout
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            wire.send_json(sock, wire.HELLO, {"layout": layout.as_dict(), "engine_id": "doomed"})
            wire.recv_json(sock, [wire.HELLO_OK])
            wire.send_json(sock, wire.PULL, {"transfer_id": params["transfer_id"], "lease_secret": params["lease_secret"],
                                             "first_block": 0, "num_blocks": len(params["block_ids"])})
            layer_bytes = len(params["block_ids"]) * layout.block_bytes_per_layer
            assert wire.recv_frame(sock, [wire.LAYER], layer_bytes)[0] == wire.LAYER
        lease = engine.kv_connector._leases[params["transfer_id"]]
        deadline = time.monotonic() + 5
        while lease.readers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.collect_kv_leases() == 0 and engine.stats().num_pinned_blocks == len(params["block_ids"])
        clock.now += 30
        assert engine.collect_kv_leases() == len(params["block_ids"])
        assert engine.stats().kv_leases_expired == 1
        assert_baseline(engine)
    finally:
        engine.close()


# -- attacks ----------------------------------------------------------------------------------------
@contextmanager
def counting_listener():
    """A listener that counts the connections it gets (where an attacker points an engine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: _accept_all(listener, accepted), daemon=True).start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def _accept_all(listener: socket.socket, accepted: list) -> None:
    while True:
        try:
            accepted.append(listener.accept()[0])
        except OSError:
            return


def test_role_both_takes_no_kv_transfer_params_at_all():
    """Before: role both (the default) accepted a client's do_remote_prefill and dialled its host:port,
    and its do_remote_decode pinned blocks; now any kv_transfer_params is refused, signed or not."""
    both = make_engine("both")
    with counting_listener() as (port, accepted):
        for params in (fake_params(port, 8, make_engine("decode")), remote_decode(), {"do_remote_decode": False}):
            with pytest.raises(InvalidRequestError, match="not accepted here: this engine runs --role both") as error:
                both.add_request("x" * 8, GREEDY, kv_transfer_params=params)
            assert error.value.param == "kv_transfer_params"
        assert not both.has_unfinished_requests() and accepted == []


@pytest.mark.parametrize("forgery", ["unsigned", "other key", "expired", "host changed after signing"])
def test_a_decode_engine_dials_nothing_for_params_it_cannot_authenticate(forgery):
    """Before: a client's do_remote_prefill naming any host:port made the engine connect there (SSRF)
    and file what it read in the shared prefix cache."""
    engine = make_engine("decode", enable_prefix_caching=True)
    prompt = "a shared system prompt " * 3
    with counting_listener() as (port, accepted):
        params = {k: v for k, v in fake_params(port, len(prompt), engine).items() if k != "do_remote_prefill"}
        unsigned = {k: v for k, v in params.items() if k not in ("mac", "expires_at")}
        params = {"unsigned": unsigned, "other key": sign_lease(unsigned, key=OTHER_KEY),
                  "expired": sign_lease(unsigned, ttl=-1), "host changed after signing": {**params, "port": port + 1}}[forgery]
        with pytest.raises(InvalidRequestError) as error:
            engine.add_request(prompt, GREEDY, kv_transfer_params=remote(params))
        assert error.value.param == "kv_transfer_params.mac"
        time.sleep(0.05)
        assert accepted == [] and not engine.has_unfinished_requests()
    assert engine.block_manager.num_cached_blocks == 0


def test_kv_loaded_from_an_unauthenticated_peer_is_never_filed_in_the_prefix_cache():
    """The cache's own guard, below the MAC check: a sequence whose pulled KV was not authenticated
    files nothing, and the same sequence authenticated files its full blocks."""
    engine = make_engine("decode", enable_prefix_caching=True)
    manager = engine.block_manager
    prompt = "p" * (3 * BLOCK)
    kv = params_module.accept(fake_params(1, len(prompt), engine), "decode", KEY, time.time())
    assert kv.remote_prefill.authenticated
    for authenticated, filed in ((False, 0), (True, 3)):
        seq = Sequence(request_id=f"s{authenticated}", prompt_token_ids=list(range(len(prompt))), params=GREEDY,
                       arrival_time=0.0)
        seq.kv_transfer = dataclasses.replace(kv, loaded=True, remote_prefill=dataclasses.replace(
            kv.remote_prefill, authenticated=authenticated))
        manager.allocate(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        manager.cache_computed_blocks(seq)
        manager.free(seq)
        assert manager.num_cached_blocks == filed  # blocks freed, and still named by the cache


def test_a_wrong_lease_secret_reads_nothing_and_frees_nothing():
    """Before: any pod that learned a transfer id (or guessed one) could PULL another user's prompt KV
    or RELEASE the lease under the decode engine's feet."""
    engine = make_engine("prefill")
    port = engine.start_kv_transfer()
    try:
        params = prefill(engine, "someone else's prompt " * 3)
        layout = engine.kv_connector.layout
        for message in (wire.PULL, wire.RELEASE):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                wire.send_json(sock, wire.HELLO, {"layout": layout.as_dict(), "engine_id": "thief"})
                wire.recv_json(sock, [wire.HELLO_OK])
                wire.send_json(sock, message, {"transfer_id": params["transfer_id"], "lease_secret": "guess",
                                               "first_block": 0, "num_blocks": len(params["block_ids"])})
                kind, body = wire.recv_json(sock, [wire.ERROR, wire.RELEASED])
                assert kind == (wire.ERROR if message == wire.PULL else wire.RELEASED)
                if message == wire.PULL:
                    assert "with that secret" in body["error"]
        lease = engine.kv_connector._leases[params["transfer_id"]]
        assert not lease.released and lease.readers == 0
        assert engine.collect_kv_leases() == 0 and engine.stats().num_pinned_blocks == len(params["block_ids"])
    finally:
        engine.close()


def test_leased_blocks_are_capped_and_a_prefill_beyond_the_cap_gets_no_lease():
    """Before: each do_remote_decode pinned its blocks for 30 s with no cap, so a caller could pin the
    whole pool and starve every other request."""
    engine = make_engine("prefill", kv_max_leased_fraction=0.125)  # 8 of 64 blocks
    engine.start_kv_transfer()
    try:
        first = prefill(engine, "a" * (5 * BLOCK), "first")  # 5 blocks
        assert len(first["block_ids"]) == 5
        assert prefill(engine, "b" * (4 * BLOCK), "second") is None  # 5 + 4 > 8: answered without a lease
        assert prefill(engine, "c" * (3 * BLOCK), "third") is not None  # 5 + 3 fits
        assert engine.stats().num_pinned_blocks == 8 and engine.kv_connector.counts.leases_refused == 1
        engine.kv_connector.release_all()
        assert_baseline(engine)
    finally:
        engine.close()


def test_control_frames_are_capped_and_layer_frames_sized_before_any_allocation():
    """Before: a 20-byte header declaring up to 2 GiB made the reader allocate that much at once."""
    one_gib = 1 << 30
    for msg_type, expect, layer_bytes, message in (
            (wire.HELLO, [wire.HELLO], None, "above the 65536-byte limit"),
            (wire.LAYER, [wire.LAYER], 4096, "declares 1073741824 bytes, the lease's blocks hold 4096"),
            (wire.LAYER, [wire.HELLO], None, "expected HELLO, got LAYER")):
        header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, msg_type, one_gib, 0)
        with pytest.raises(FrameError, match=message):
            wire.recv_frame(_socketpair_with(header), expect, layer_bytes)


def test_the_listener_caps_connections_and_its_accept_loop_outlives_them():
    """Before: one thread per connection with no cap; a flood of idle connections took threads and
    file descriptors without bound."""
    engine = make_engine("prefill")
    transport = engine.kv_connector.transport
    transport.max_connections = 2
    port = engine.start_kv_transfer()
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        deadline = time.monotonic() + 5
        while len(transport._connections) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            assert third.recv(1) == b""  # closed at once
        assert transport.refused_connections == 1
        for sock in idle:
            sock.close()
        while transport._connections:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        decode_engine = make_engine("decode")
        prompt = "still serving " * 4
        params = prefill(engine, prompt)
        decode_engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=remote(params))
        assert run(decode_engine)["d"].outputs[0].token_ids == reference(prompt)
        assert decode_engine.stats().kv_pulls_ok == 1
        decode_engine.close()
    finally:
        engine.close()


def test_a_handshake_that_never_comes_is_cut_at_the_handshake_timeout():
    """Before: a connection that sent nothing held its thread for the 30 s idle timeout, renewed by
    every byte it trickled."""
    engine = make_engine("prefill")
    engine.kv_connector.transport.handshake_timeout = 0.3
    port = engine.start_kv_transfer()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(wire.MAGIC)  # a trickle: part of a header, then nothing
            time.sleep(0.1)
            sock.sendall(b"\x00")
            assert sock.recv(1) == b""
            assert time.monotonic() - started < 2
    finally:
        engine.close()


def test_a_pull_times_out_on_the_engine_clock():
    """Leases and pulls read the same injected clock: advancing it past --kv-transfer-timeout gives up
    a pull stuck on a hung prefill engine without waiting in real time (pulls read time.monotonic())."""
    clock = ManualClock()
    prompt = "hung on a fake clock " * 2
    with black_hole() as port:
        engine = make_engine("decode", clock=clock, kv_transfer_timeout=60)
        engine.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=fake_params(port, len(prompt), engine))
        engine.step()
        assert engine.stats().num_waiting_for_kv == 1
        started = time.monotonic()
        clock.now += 61.5
        out = run(engine)["d"]
        assert time.monotonic() - started < 5
        assert out.error is None and out.outputs[0].token_ids == reference(prompt)
        assert engine.stats().kv_pulls_failed == 1
        assert_baseline(engine)


def test_prefill_and_decode_roles_need_a_readable_key(tmp_path):
    for role in ("prefill", "decode"):
        with pytest.raises(ConfigError, match=f"--role {role} needs --kv-auth-key-file"):
            EngineConfig(model="fake", role=role).resolve()
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny\n")
    with pytest.raises(ConfigError, match="--kv-auth-key-file .*the key has 4 bytes, at least 16"):
        auth.load_key(str(short))
    with pytest.raises(ConfigError, match="cannot read the KV auth key"):
        auth.load_key(str(tmp_path / "absent.key"))
    assert auth.load_key(key_file()) == KEY  # the trailing newline of a Secret's file is not part of it


def test_a_reader_that_stops_reading_is_cut_at_the_lease_expiry():
    """Before: each send had its own 30 s timeout, so a puller reading a byte now and then held the
    serving thread and the lease's blocks without end; now the lease's expiry bounds the whole read."""
    closed = threading.Event()

    class Source:
        layout, engine_id = LAYOUT, "prefill"

        def open_read(self, transfer_id, secret, first_block, num_blocks):
            return LeaseRead(list(range(num_blocks)), time.monotonic() + 1.0)

        def read_layers(self, block_ids):
            half = memoryview(bytes(len(block_ids) * LAYOUT.block_bytes_per_layer // 2))
            for _ in range(LAYOUT.num_layers):  # 30 layers of 1.5 MiB: far more than the socket buffers
                yield half, half

        def close_read(self, transfer_id):
            closed.set()

        def release(self, transfer_id, secret):
            return False

    transport = TcpTransport()
    port = transport.listen(Source(), "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            wire.send_json(sock, wire.HELLO, {"layout": LAYOUT.as_dict(), "engine_id": "slow"})
            wire.recv_json(sock, [wire.HELLO_OK])
            wire.send_json(sock, wire.PULL, {"transfer_id": "t", "lease_secret": "s", "first_block": 0, "num_blocks": 64})
            started = time.monotonic()
            assert closed.wait(5), "the read was not cut"
            assert time.monotonic() - started < 2.5
    finally:
        transport.close()
