"""What the nodes of a multi-node group must agree on (engine/distributed/multinode.py): the leader's
resolution of --dtype/--device auto reaches the other ranks through the rendezvous store, a node that
cannot run it refuses naming the cause, and each node advertises an address the others reach."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from iterserve.engine import model_runner
from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.distributed import multinode


def _config(**changes) -> EngineConfig:
    return EngineConfig(model="/models/x", tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=1,
                        **changes)


def test_a_worker_whose_own_auto_dtype_differs_loads_with_the_leaders(monkeypatch):
    leader = _config()  # --dtype auto --device auto on every node
    assert leader.dtype == "auto"
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    # the leader measured bf16 faster; it publishes its choice with the config
    store.set("config", multinode.config_json(multinode.agreed_config(leader, torch.device("cpu"), torch.bfloat16)))
    # this worker's own micro-benchmark would pick float32
    monkeypatch.setattr(model_runner.cpu_dtype, "auto_cpu_dtype", lambda hidden, intermediate: torch.float32)
    shape = SimpleNamespace(hidden_size=64, intermediate_size=128)  # what pick_dtype reads of the model
    cpu = torch.device("cpu")
    assert model_runner.pick_dtype(leader.dtype, cpu, shape) == torch.float32  # what it would choose alone
    client = TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
    received = multinode.config_from_json(client.get("config"))
    multinode.check_leader_choices(received)
    assert (received.dtype, received.device) == ("bfloat16", "cpu")
    assert model_runner.pick_dtype(received.dtype, cpu, shape) == torch.bfloat16
    assert received.tensor_parallel_size == 2 and received.model == "/models/x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of CUDA on a node without it")
def test_a_node_refuses_a_device_it_cannot_run_naming_the_leaders_choice():
    with pytest.raises(ConfigError, match=r"the leader \(node 0\) resolved --device cuda --dtype bfloat16.*"
                                          r"no CUDA device.*--dtype float32"):
        multinode.check_leader_choices(_config(device="cuda", dtype="bfloat16"))
    multinode.check_leader_choices(_config(device="cpu", dtype="float32"))


def test_the_leader_advertises_its_own_address_not_loopbacks_source():
    # a pod IP on the local cluster (127.10.x.y): the route to one's own address goes through lo with
    # source 127.0.0.1, which is what the leader used to advertise
    assert multinode.own_address("127.10.0.5", 29500) == "127.0.0.1"
    assert multinode.leader_address("127.10.0.5", 29500) == "127.10.0.5"
    assert multinode.leader_address("127.0.0.1", 29500) == "127.0.0.1"  # one machine: loopback still works


def test_a_leader_behind_an_address_it_does_not_own_advertises_its_pods(monkeypatch):
    virtual = "192.0.2.1"  # --master-addr naming, e.g., a Service's virtual IP: not this machine's
    try:
        route = multinode.own_address(virtual, 29500)
    except OSError:
        pytest.skip("no route off this machine")
    monkeypatch.setattr(multinode.socket, "gethostname", lambda: "localhost")  # the hostname says loopback
    assert multinode.leader_address(virtual, 29500) == route  # then: the route's source
    monkeypatch.setattr(multinode.socket, "gethostname", lambda: route)  # the pod's name resolves to its IP
    assert multinode.leader_address(virtual, 29500) == route
    monkeypatch.setattr(multinode.socket, "gethostname", lambda: "127.0.0.1")
    assert not multinode.leader_address(virtual, 29500).startswith("127.")
