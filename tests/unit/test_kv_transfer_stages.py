"""KV transfer of a tensor x pipeline cache (engine/kv_transfer/sharded.py) over real TCP on
127.0.0.1, the four ranks of each engine (tensor 2 x pipeline 2; rank r is stage r // 2, tensor rank
r % 2) as objects of this process joined by direct calls: rank r of the decode side gets exactly
rank r's bytes of the prefill side (its heads of its stage's layers); one outcome for every rank
when a later stage's pull fails, which the error names by stage and tensor rank; the handshake
refuses a rank of another stage or of another split of the layers, naming the field; and a lease's
pipeline_parallel_size and its listeners (one per rank after the first) are bounded and checked;
`iterserve serve` refuses a --kv-transfer-port whose run of one port per rank passes 65535 or
takes the HTTP port."""

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

TP, STAGES, LAYERS, BLOCK_BYTES = 2, 2, 3, 64  # LAYERS: each stage's


def layout(rank: int, first_layer: int | None = None) -> KVLayout:
    stage, tensor_rank = divmod(rank, TP)
    return KVLayout(model="m/none", dtype="float32", num_layers=LAYERS, num_kv_heads=1, head_size=2, block_size=4,
                    itemsize=4, shard=f"{tensor_rank}/{TP}", stage=f"{stage}/{STAGES}",
                    first_layer=stage * LAYERS if first_layer is None else first_layer)


def blocks_of(rank: int):
    return shard_blocks(rank, LAYERS, BLOCK_BYTES)


class Leader:
    """Rank 0's KV source (the connector's part of it): one lease."""

    engine_id = "prefill"

    def __init__(self, blocks: list[int]):
        self.layout, self.blocks, self.released = layout(0), blocks, threading.Event()

    def open_read(self, transfer_id, secret, first_block, num_blocks):
        if (transfer_id, secret) != ("t1", "s3cret"):
            raise KVTransferError("no such lease")
        return LeaseRead(self.blocks[first_block : first_block + num_blocks], time.monotonic() + 30)

    def read_layers(self, block_ids):
        return blocks_of(0)(block_ids)

    def close_read(self, transfer_id):
        pass

    def release(self, transfer_id, secret):
        self.released.set()
        return True


class Links:
    """Rank 0's links to ranks 1..3, delivered by direct calls."""

    tp, stages = TP, STAGES

    def __init__(self, read=blocks_of):
        self.transport = None
        self.servers = {rank: ShardServer(rank, layout(rank), read(rank),
                                          lambda message, rank=rank: self.transport.deliver(rank, message))
                        for rank in range(1, TP * STAGES)}

    def send(self, rank, message):
        threading.Thread(target=self.servers[rank].handle, args=(message,), daemon=True).start()


@pytest.fixture
def sides():
    """(prefill transport, its leader, its port, decode links): every rank of both sides, closed after."""
    prefill_links, decode_links = Links(), Links(lambda rank: lambda ids: iter(()))
    prefill = prefill_links.transport = ShardedTransport(prefill_links)
    decode = decode_links.transport = ShardedTransport(decode_links)
    leader = Leader([7, 3, 9])
    port = prefill.listen(leader, "127.0.0.1", 0)
    prefill.lease_opened("t1", "s3cret", leader.blocks, 30.0)
    yield prefill, leader, port, decode_links
    for each in (prefill, decode, *prefill_links.servers.values(), *decode_links.servers.values()):
        each.close()


def request(port, shards, key="req-1"):
    return PullRequest("127.0.0.1", port, "t1", "s3cret", 1, 2, time.monotonic() + 10, key=key, shards=tuple(shards))


def test_rank_r_gets_rank_rs_layers_of_its_stage_and_the_lease_is_released_once_all_have_theirs(sides):
    prefill, leader, port, decode_links = sides
    decode = decode_links.transport
    shards = prefill.shard_addresses("127.0.0.1")
    assert len(shards) == TP * STAGES - 1
    result = decode.pull(request(port, shards), layout(0), "decode")
    assert bytes(result.layers[2][:1]) == bytes([32 + 3])  # rank 0, its layer 2, block 3 (the lease's second)
    assert result.released and leader.released.is_set()
    decode.settled(request(port, []))
    key = decode.take_settled()["req-1"]
    for rank, server in decode_links.servers.items():
        shard = server.take(key, [0, 1])
        for local_layer in range(LAYERS):
            assert bytes(shard.layers[local_layer][:1]) == bytes([(rank * 64 + local_layer * 16 + 3) % 256]), rank
            assert bytes(shard.layers[local_layer][-1:]) == bytes([(rank * 64 + local_layer * 16 + 9) % 256]), rank
    assert result.num_bytes > TP * STAGES * LAYERS * 2 * BLOCK_BYTES  # every rank's shard


def test_a_failure_on_a_later_stage_fails_the_pull_naming_its_stage_and_tensor_rank(sides):
    prefill, leader, port, decode_links = sides
    shards = list(prefill.shard_addresses("127.0.0.1"))
    shards[2] = ("127.0.0.1", 1)  # rank 3 cannot connect
    with pytest.raises(KVTransferError, match=r"rank 3 \(pipeline stage 1, tensor rank 1\): cannot connect"):
        decode_links.transport.pull(request(port, shards), layout(0), "decode")
    assert leader.released.wait(5)  # rank 0 pulled its shard, then freed the lease nobody will load


@pytest.mark.parametrize("puller,refusal", [
    (layout(2), "stage: '0/2' here vs '1/2' there"),  # another stage's rank of the same tensor rank
    (layout(0, first_layer=1), "first_layer: 0 here vs 1 there"),  # the same stage of another split
])
def test_the_handshake_refuses_a_rank_of_another_stage_or_split_naming_the_field(puller, refusal):
    transport = TcpTransport()
    port = transport.listen(Leader([0]), "127.0.0.1", 0)
    try:
        with pytest.raises(KVTransferError, match=refusal):
            transport.pull(PullRequest("127.0.0.1", port, "t1", "s3cret", 0, 1, time.monotonic() + 5, release=False),
                           puller, "decode")
    finally:
        transport.close()


LEASE = {"transfer_id": "t", "engine_id": "e", "host": "10.0.0.1", "port": 8100, "block_ids": [1, 2],
         "num_tokens": 20, "block_size": 16, "compat_hash": "h", "lease_expires_at": 1e10, "lease_secret": "s",
         "do_remote_prefill": True}


def test_a_staged_lease_names_one_listener_per_rank_after_the_first():
    shards = [["10.0.0.1", 8101], ["10.0.0.2", 8102], ["10.0.0.2", 8103]]
    remote = kv_params.parse_request({**LEASE, "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                      "shards": shards}).remote_prefill
    assert (remote.tensor_parallel_size, remote.pipeline_parallel_size) == (2, 2)
    assert remote.shards == tuple(tuple(entry) for entry in shards)
    remote = kv_params.parse_request({**LEASE, "shards": [["10.0.0.1", 8101]], "pipeline_parallel_size": 2}).remote_prefill
    assert (remote.tensor_parallel_size, remote.pipeline_parallel_size) == (1, 2)
    assert kv_params.parse_request(LEASE).remote_prefill.pipeline_parallel_size == 1  # a lease without: one stage


@pytest.mark.parametrize("fields,param", [
    ({"pipeline_parallel_size": 2}, "kv_transfer_params.shards"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "shards": [["h", 1]]}, "kv_transfer_params.shards"),
    ({"pipeline_parallel_size": 0}, "kv_transfer_params.pipeline_parallel_size"),
    ({"pipeline_parallel_size": 65}, "kv_transfer_params.pipeline_parallel_size"),
    ({"pipeline_parallel_size": "2"}, "kv_transfer_params.pipeline_parallel_size"),
    ({"pipeline_parallel_size": True}, "kv_transfer_params.pipeline_parallel_size"),
])
def test_a_malformed_staged_lease_is_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as refused:
        kv_params.parse_request({**LEASE, **fields})
    assert refused.value.param == param


def test_serve_refuses_a_kv_port_whose_run_for_every_rank_of_tensor_x_pipeline_passes_65535():
    from iterserve.engine.config import ConfigError
    from iterserve.engine.server.cli import check_server_args, serve_parser

    def check(*flags: str) -> None:
        check_server_args(serve_parser().parse_args(["--role", "prefill", *flags]))

    check("--kv-transfer-port", "65532", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    with pytest.raises(ConfigError, match="--kv-transfer-port 65533 \\+ 4 ranks - 1 passes 65535"):
        check("--kv-transfer-port", "65533", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    with pytest.raises(ConfigError, match="takes the HTTP --port 8001"):
        check("--kv-transfer-port", "8000", "--pipeline-parallel-size", "2", "--port", "8001")
