"""KV transfer of a sharded cache (engine/kv_transfer/sharded.py) over real TCP on 127.0.0.1, with
the ranks of each engine as objects of this process joined by direct calls (what the rank processes'
connection carries in an engine): rank i of the decode side gets exactly rank i's bytes of the
prefill side; one outcome for every rank when one rank's pull fails; a staged shard is dropped
when rank 0 settles the pull without loading it; rank i cannot read rank j's shard; and the
kv_transfer_params of a tensor-parallel lease are bounded and checked."""

from __future__ import annotations

import threading
import time

import pytest

from iterserve.engine.kv_transfer import params as kv_params
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.sharded import ShardedTransport, ShardServer
from iterserve.engine.kv_transfer.transport import LeaseRead, PullRequest, TcpTransport
from iterserve.engine.kv_transfer.wire import KVTransferError
from iterserve.engine.sampling_params import InvalidRequestError
from tests.kv_shard_helpers import shard_blocks

LAYERS, BLOCK_BYTES = 2, 64


def layout(rank: int) -> KVLayout:
    return KVLayout(model="m/none", dtype="float32", num_layers=LAYERS, num_kv_heads=1, head_size=2, block_size=4,
                    itemsize=4, shard=f"{rank}/2")


def blocks_of(rank: int):
    return shard_blocks(rank, LAYERS, BLOCK_BYTES)


class Leader:
    """Rank 0's KV source (the connector's part of it): one lease."""

    engine_id = "prefill"

    def __init__(self, transfer_id: str, secret: str, blocks: list[int]):
        self.layout, self.lease, self.released = layout(0), (transfer_id, secret, blocks), threading.Event()

    def open_read(self, transfer_id, secret, first_block, num_blocks):
        if (transfer_id, secret) != self.lease[:2]:
            raise KVTransferError("no such lease")
        return LeaseRead(self.lease[2][first_block : first_block + num_blocks], time.monotonic() + 30)

    def read_layers(self, block_ids):
        return blocks_of(0)(block_ids)

    def close_read(self, transfer_id):
        pass

    def release(self, transfer_id, secret):
        self.released.set()
        return True


class Links:
    """Rank 0's links to rank 1, delivered by direct calls."""

    tp, stages = 2, 1

    def __init__(self, make_server):
        self.transport = None
        self.server = make_server(lambda message: self.transport.deliver(1, message))

    def send(self, rank, message):
        assert rank == 1
        threading.Thread(target=self.server.handle, args=(message,), daemon=True).start()


def prefill_side(blocks):
    links = Links(lambda reply: ShardServer(1, layout(1), blocks_of(1), reply))
    transport = links.transport = ShardedTransport(links)
    leader = Leader("t1", "s3cret", blocks)
    port = transport.listen(leader, "127.0.0.1", 0)
    transport.lease_opened("t1", "s3cret", blocks, 30.0)
    return transport, leader, port


def decode_side():
    links = Links(lambda reply: ShardServer(1, layout(1), lambda ids: iter(()), reply))
    transport = links.transport = ShardedTransport(links)
    return transport, links.server


def request(port, shards, key="req-1", first=0, num=3):
    return PullRequest("127.0.0.1", port, "t1", "s3cret", first, num, time.monotonic() + 10, key=key,
                       shards=tuple(shards))


@pytest.fixture
def sides():
    made = []

    def make(blocks=(7, 3, 9)):
        prefill, leader, port = prefill_side(list(blocks))
        decode, server = decode_side()
        made.extend([prefill, decode, server, prefill.links.server])
        return prefill, leader, port, decode, server
    yield make
    for each in made:
        each.close()


def test_rank_i_gets_rank_is_shard_and_rank_0_releases_the_lease_once_all_have_theirs(sides):
    prefill, leader, port, decode, server = sides()
    result = decode.pull(request(port, prefill.shard_addresses("127.0.0.1"), first=1, num=2), layout(0), "decode")
    assert bytes(result.layers[1][:1]) == bytes([16 + 3])  # rank 0, layer 1, block 3 (the lease's second)
    assert result.released and leader.released.is_set()
    decode.settled(request(port, [], key="req-1"))
    settled = decode.take_settled()
    shard = server.take(settled["req-1"], [0, 1])
    assert bytes(shard.layers[0][: BLOCK_BYTES // 2]) == bytes([64 + 3]) * (BLOCK_BYTES // 2)  # rank 1's block 3
    assert bytes(shard.layers[1][BLOCK_BYTES // 2 : BLOCK_BYTES]) == bytes([64 + 16 + 9]) * (BLOCK_BYTES // 2)
    assert result.num_bytes > 2 * LAYERS * 2 * BLOCK_BYTES  # both ranks' shards


def test_a_failure_on_rank_1_fails_the_pull_and_rank_0_releases_the_lease(sides):
    prefill, leader, port, decode, server = sides()
    with pytest.raises(KVTransferError, match="tensor rank 1: cannot connect"):
        decode.pull(request(port, [("127.0.0.1", 1)]), layout(0), "decode")
    assert leader.released.wait(5)  # rank 0 pulled its shard, then freed the lease nobody will load


def test_a_shard_staged_for_a_pull_rank_0_does_not_load_is_dropped(sides):
    prefill, leader, port, decode, server = sides()
    decode.pull(request(port, prefill.shard_addresses("127.0.0.1")), layout(0), "decode")
    decode.settled(request(port, [], key="req-1"))
    key = decode.take_settled()["req-1"]
    server.forget(key)  # the step plan's kv_forget: say the sequence was preempted before its load
    with pytest.raises(RuntimeError, match="has not pulled"):
        server.take(key, [0, 1, 2])


def test_an_aborted_pull_orders_nothing_on_the_other_ranks(sides):
    prefill, leader, port, decode, server = sides()
    aborted = request(port, prefill.shard_addresses("127.0.0.1"))
    aborted.cancel.set()
    decode.settled(aborted)
    with pytest.raises(KVTransferError, match="aborted"):
        decode.pull(aborted, layout(0), "decode")
    assert decode.take_settled() == {} and server._staged == {}


def test_rank_1_cannot_read_rank_0s_shard():
    transport = TcpTransport()
    port = transport.listen(Leader("t1", "s3cret", [0]), "127.0.0.1", 0)
    try:
        with pytest.raises(KVTransferError, match="shard: '0/2' here vs '1/2' there"):
            transport.pull(PullRequest("127.0.0.1", port, "t1", "s3cret", 0, 1, time.monotonic() + 5, release=False),
                           layout(1), "decode-rank1")
    finally:
        transport.close()


def test_a_ranks_listener_serves_only_leases_rank_0_announced_with_their_secret(sides):
    prefill, leader, port, decode, server = sides()
    rank1 = prefill.shard_addresses("127.0.0.1")[0][1]
    puller = TcpTransport()
    for transfer_id, secret in (("t1", "wrong"), ("t2", "s3cret")):
        with pytest.raises(KVTransferError, match="no lease"):
            puller.pull(PullRequest("127.0.0.1", rank1, transfer_id, secret, 0, 1, time.monotonic() + 5, release=False),
                        layout(1), "decode-rank1")
    prefill.lease_closed("t1")
    deadline = time.monotonic() + 5
    while "t1" in prefill.links.server._leases:
        assert time.monotonic() < deadline
        time.sleep(0.01)


LEASE = {"transfer_id": "t", "engine_id": "e", "host": "10.0.0.1", "port": 8100, "block_ids": [1, 2],
         "num_tokens": 20, "block_size": 16, "compat_hash": "h", "lease_expires_at": 1e10, "lease_secret": "s",
         "do_remote_prefill": True}


def test_a_tensor_parallel_lease_names_one_listener_per_other_rank():
    state = kv_params.parse_request({**LEASE, "tensor_parallel_size": 3, "shards": [["10.0.0.1", 8101],
                                                                                   ["10.0.0.2", 8102]]})
    assert state.remote_prefill.tensor_parallel_size == 3
    assert state.remote_prefill.shards == (("10.0.0.1", 8101), ("10.0.0.2", 8102))
    assert kv_params.parse_request(LEASE).remote_prefill.tensor_parallel_size == 1  # a lease without: one rank


@pytest.mark.parametrize("fields,param", [
    ({"tensor_parallel_size": 2}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 2, "shards": [["h", 1], ["h", 2]]}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 2, "shards": [["h", 0]]}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 2, "shards": [["h", True]]}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 2, "shards": [["x" * 254, 1]]}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 2, "shards": ["h:1"]}, "kv_transfer_params.shards"),
    ({"tensor_parallel_size": 0}, "kv_transfer_params.tensor_parallel_size"),
    ({"tensor_parallel_size": 65}, "kv_transfer_params.tensor_parallel_size"),
    ({"tensor_parallel_size": "2"}, "kv_transfer_params.tensor_parallel_size"),
])
def test_a_malformed_tensor_parallel_lease_is_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as refused:
        kv_params.parse_request({**LEASE, **fields})
    assert refused.value.param == param


def test_prefill_and_decode_roles_take_tensor_parallelism_stages_and_nodes(tmp_path):
    from iterserve.engine.config import EngineConfig
    from tests.kv_auth_helpers import key_file

    for options in ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "nnodes": 2},
                    {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}):
        for role in ("prefill", "decode"):
            EngineConfig(model="fake", role=role, kv_auth_key_file=key_file(), **options).resolve()


def test_a_step_plan_loads_the_shards_of_this_steps_loads_and_drops_every_other_settled_pull():
    """Rank 0's decision as the other ranks get it: the pulls the scheduler settled since the last
    plan are loaded (this step's kv_loads) or dropped (failed, aborted, or preempted before the load)."""
    from types import SimpleNamespace

    from iterserve.engine.distributed.tensor_parallel import StepPlan, TensorParallelRunner
    from iterserve.engine.scheduler import KVLoad, SchedulerOutput

    runner = TensorParallelRunner.__new__(TensorParallelRunner)
    settled = {"loaded": "loaded#0", "preempted": "preempted#1", "failed": "failed#2"}
    runner._kv_transport = SimpleNamespace(take_settled=lambda: dict(settled))
    out = SchedulerOutput(kv_loads=[KVLoad(SimpleNamespace(request_id="loaded"), [5, 6], [])])
    plan = StepPlan([], [], [], [], [], [], [], [])
    runner._plan_kv(out, plan)
    assert plan.kv_loads == [("loaded#0", [5, 6])]
    assert sorted(plan.kv_forget) == ["failed#2", "preempted#1"]
    settled = {}  # a load of a pull the other ranks never made: rank 0 refuses to run the step
    with pytest.raises(RuntimeError, match="no pull on the other tensor ranks"):
        runner._plan_kv(out, StepPlan([], [], [], [], [], [], [], []))
