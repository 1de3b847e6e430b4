"""The NetworkPolicy of an InferenceService's engine pods (NetworkPolicy `<name>-engines`, owned
by it): who may reach which port of its engines. Pure builder; reconcile.py applies it.

- The HTTP port (completions, /metrics, the admin API): in Router mode only from the
  InferenceService's own router pods and from the peers the operator is given (its own pods, to
  read /metrics and set max_num_seqs, and Prometheus: chart values `networkPolicy.*`). In None and
  Gateway modes clients (or the gateway) reach the engines directly, so the port stays open.
- The KV transfer ports (disaggregation; rank r of tensor x pipeline listens on kvTransferPort + r,
  on whichever node of a group runs it): the whole range on every engine pod, only from the
  InferenceService's decode pods, the one pool that dials them (decode pulls each shard from a
  prefill engine's rank; only prefill engines listen).
- Multi-node groups (spec.engine.parallelism.nodes > 1): every other port from pods of the same
  InferenceService: the leader's rendezvous port, and the ports gloo and NCCL pick at random
  between the members. With disaggregation that rule leaves out the KV range, so a prefill pod
  reaches no other prefill pod's KV listener.
- Every other port of the engine pods: closed (the policy selects them with policyTypes Ingress).

Whether it is enforced is the cluster's network plugin's business (Calico, Cilium, ...; kindnet
and the local pod runtime do not): docs/security.md says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from iterserve.labels import DECODE, ROLE_LABEL, selector_labels
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.resources import (
    ENGINE_PORT,
    Owner,
    common_labels,
    kv_port_range,
    owner_reference,
)

KIND = "NetworkPolicy"
MAX_PORT = 65535
PEER_KEYS = ("namespaceSelector", "podSelector")
SELECTOR_KEYS = ("matchLabels", "matchExpressions")


def policy_name(name: str) -> str:
    return f"{name}-engines"


@dataclass(frozen=True)
class NetworkPolicySettings:
    """The operator's settings (flags --no-network-policy, --network-policy-peer)."""

    enabled: bool = True
    # NetworkPolicyPeers (namespaceSelector and/or podSelector) allowed to the engines' HTTP port
    # besides the router: the operator and Prometheus.
    peers: tuple[dict[str, Any], ...] = ()


DEFAULT_SETTINGS = NetworkPolicySettings()


def parse_peer(text: str) -> dict[str, Any]:
    """A peer from its JSON form, e.g. '{"namespaceSelector": {"matchLabels": {...}}, "podSelector": {...}}'.
    Raises ValueError naming the flag and what is wrong (ipBlock is refused: pod IPs change)."""
    try:
        peer = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--network-policy-peer {text!r}: not JSON ({error})") from None
    if not isinstance(peer, dict) or not peer or any(key not in PEER_KEYS for key in peer):
        raise ValueError(f"--network-policy-peer {text!r}: an object with namespaceSelector and/or podSelector")
    for key, selector in peer.items():
        if not isinstance(selector, dict) or any(k not in SELECTOR_KEYS for k in selector):
            raise ValueError(f"--network-policy-peer {text!r}: {key} must be a label selector "
                             "(matchLabels, matchExpressions)")
    return peer


def build_for(owner: Owner, spec: InferenceServiceSpec, settings: NetworkPolicySettings) -> list[dict[str, Any]]:
    """The policy this InferenceService should have (none when the operator runs without)."""
    from iterserve.operator import routing

    if not settings.enabled:
        return []
    labels = routing.router_labels(owner.name) if spec.routing.mode == routing.ROUTER else None
    return [build_network_policy(owner, spec, settings, labels)]


def build_network_policy(owner: Owner, spec: InferenceServiceSpec, settings: NetworkPolicySettings,
                         router_labels: dict[str, str] | None) -> dict[str, Any]:
    """`router_labels`: the router pods' labels in Router mode, None when clients reach engines directly."""
    http: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}
    if router_labels is not None:
        http["from"] = [{"podSelector": {"matchLabels": dict(router_labels)}}, *settings.peers]
    ingress = [http]
    members = {"from": [{"podSelector": {"matchLabels": selector_labels(owner.name)}}]}
    if spec.disaggregation.enabled:
        first, last = kv_port_range(spec)
        kv_port = {"protocol": "TCP", "port": first, **({"endPort": last} if last > first else {})}
        decode = {**selector_labels(owner.name), ROLE_LABEL: DECODE}
        ingress.append({"from": [{"podSelector": {"matchLabels": decode}}], "ports": [kv_port]})
        members["ports"] = _every_port_but(first, last)
    if spec.engine.parallelism.nodes > 1:
        ingress.append(members)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": {"name": policy_name(owner.name), "namespace": owner.namespace,
                     "labels": common_labels(owner.name), "ownerReferences": [owner_reference(owner)]},
        "spec": {"podSelector": {"matchLabels": selector_labels(owner.name)},
                 "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _every_port_but(first: int, last: int) -> list[dict[str, Any]]:
    """Every TCP and UDP port outside first..last, as NetworkPolicy port ranges."""
    ranges = [(low, high) for low, high in ((1, first - 1), (last + 1, MAX_PORT)) if low <= high]
    return [{"protocol": protocol, "port": low, **({"endPort": high} if high > low else {})}
            for protocol in ("TCP", "UDP") for low, high in ranges]
