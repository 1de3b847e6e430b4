"""The chart's NetworkPolicy and RuntimeClass values reach the operator as flags its CLI parses:
the operator's own pods and Prometheus as peers (parsed by network_policy.parse_peer), the switch
off, and the allowed RuntimeClasses, which the admission policy's CEL lists too."""

from __future__ import annotations

from iterserve.operator import network_policy
from tests.unit.chart_tools import of_kind, render


def _operator_args(*sets: str) -> list[str]:
    [deployment] = of_kind(render(sets=sets), "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _parsed(args: list[str]):
    from iterserve.cli import build_parser
    from iterserve.operator import cli as operator_cli

    parser, subparsers = build_parser()
    operator_cli.configure(subparsers.add_parser("operator"))
    return parser.parse_args(args)


def test_by_default_the_operator_and_prometheus_are_the_peers():
    args = _parsed(_operator_args())
    assert args.network_policy is True
    operator, prometheus = (network_policy.parse_peer(p) for p in args.network_policy_peer)
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "iterserve-system"}}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert prometheus == {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_extra_peers_are_passed_and_the_policy_can_be_turned_off():
    args = _parsed(_operator_args("networkPolicy.extraPeers[0].podSelector.matchLabels.app=agent"))
    assert network_policy.parse_peer(args.network_policy_peer[-1]) == {"podSelector": {"matchLabels": {"app": "agent"}}}
    off = _parsed(_operator_args("networkPolicy.enabled=false"))
    assert off.network_policy is False and off.network_policy_peer == []


def test_allowed_runtime_classes_reach_the_operator_and_the_admission_policy():
    objects = render(sets=("admissionPolicy.runtimeClasses={nvidia,kata}",))
    [deployment] = of_kind(objects, "Deployment")
    args = _parsed(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.allow_runtime_class == ["nvidia", "kata"]
    [policy] = of_kind(objects, "ValidatingAdmissionPolicy")
    runtime = [v["expression"] for v in policy["spec"]["validations"] if "runtimeClassName" in v["expression"]]
    assert len(runtime) == 1 and "in ['nvidia', 'kata']" in runtime[0]
