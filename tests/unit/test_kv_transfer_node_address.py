"""Where a prefill rank of another node listens for KV transfers (engine/kv_transfer/sharded.py
`listen_host`, engine/distributed/multinode.py `kv_address`): at the address it advertises, not at
the leader's. Real sockets on 127.0.0.0/8, where every address shares one loopback as the local pod
runtime's pods do: binding the leader's 127.0.0.1 there succeeds, and a decode rank dialing the
rank's own address would be refused."""

from __future__ import annotations

import pytest

from iterserve.engine.distributed import multinode
from iterserve.engine.kv_transfer.sharded import ShardedTransport, ShardServer, listen_host
from tests.unit.test_kv_transfer_sharded import (
    Leader,
    Links,
    blocks_of,
    decode_side,
    layout,
    request,
)


def test_a_rank_of_another_node_listens_where_it_advertises_and_decode_pulls_its_shard():
    """Rank 1 runs on a node whose address is 127.0.0.2; the leader's KV host is 127.0.0.1."""
    links = Links(lambda reply: ShardServer(1, layout(1), blocks_of(1), reply, advertise="127.0.0.2"))
    prefill = links.transport = ShardedTransport(links)
    leader = Leader("t1", "s3cret", [7, 3, 9])
    decode, staged = decode_side()
    try:
        port = prefill.listen(leader, "127.0.0.1", 0)
        prefill.lease_opened("t1", "s3cret", [7, 3, 9], 30.0)
        [(host, rank_port)] = prefill.shard_addresses("127.0.0.1")
        assert host == "127.0.0.2"  # the lease names the rank's own node, and that is where it listens
        result = decode.pull(request(port, [(host, rank_port)]), layout(0), "decode")
        assert result.released and leader.released.is_set()
        decode.settled(request(port, [], key="req-1"))
        shard = staged.take(decode.take_settled()["req-1"], [0, 1, 2])
        assert bytes(shard.layers[0][:1]) == bytes([64 + 7])  # rank 1's layer 0 of the lease's first block
    finally:
        for each in (prefill, decode, staged, links.server):
            each.close()


@pytest.mark.parametrize("leader, advertise, bound", [
    ("127.0.0.1", None, "127.0.0.1"),  # a rank of the leader's node: the leader's address
    ("10.0.0.1", None, "10.0.0.1"),
    ("127.0.0.1", "127.0.0.2", "127.0.0.2"),  # another node: its own address, which the lease names
    ("10.0.0.1", "10.0.0.2", "10.0.0.2"),
    ("0.0.0.0", "10.0.0.2", "0.0.0.0"),  # the leader binds every interface: so does the rank
    ("::", "10.0.0.2", "0.0.0.0"),  # ... of the family of the address it advertises
    ("0.0.0.0", "fd00::2", "::"),
    ("::", None, "::"),
])
def test_the_listener_binds_the_leaders_address_on_its_node_else_the_advertised_one(leader, advertise, bound):
    assert listen_host(leader, advertise) == bound


def test_a_node_whose_route_to_the_leader_is_the_loopback_advertises_its_own_host():
    """On one machine the route to any 127.x address has source 127.0.0.1, every pod's: a node
    started with --host 127.0.0.2 (its pod IP) advertises that, so two groups' rank r do not both
    bind kvTransferPort + r on 127.0.0.1."""
    assert multinode.own_address("127.0.0.1", 29500) == "127.0.0.1"
    assert multinode.kv_address("127.0.0.2", "127.0.0.1", 29500) == "127.0.0.2"
    assert multinode.kv_address("127.0.0.3", "127.0.0.1", 29500) == "127.0.0.3"
    # --host every interface (the operator's, in a cluster): the route's source, as gloo binds
    assert multinode.kv_address("0.0.0.0", "127.0.0.1", 29500) == "127.0.0.1"
    # an address this machine does not own is no address to advertise
    assert multinode.kv_address("192.0.2.123", "127.0.0.1", 29500) == "127.0.0.1"
