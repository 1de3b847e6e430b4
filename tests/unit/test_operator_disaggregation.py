"""spec.disaggregation through the reconcile (in-memory Kube): the prefill pool's own Deployment,
role labels and flags on both pools, the router's P/D flags, replica bounds, the
DisaggregationIneffective condition from the observed average prompt, and turning it off."""

from __future__ import annotations

import base64
import copy
from datetime import UTC, datetime
from pathlib import Path

import pytest

from iterserve.operator import disaggregation, routing
from iterserve.operator.autoscaling import policy
from iterserve.operator.autoscaling.report import AutoscalerTick, Record, average_prompt
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.validation import SpecError, parse_spec
from iterserve.router.discovery import ROLE_LABEL
from tests.unit.test_operator_value_flow import MemoryKube

SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 2, "engine": {"extraArgs": ["--fake-model"]},
        "disaggregation": {"enabled": True, "thresholdTokens": 512,
                           "prefill": {"replicas": 9, "minReplicas": 1, "maxReplicas": 3}}}


def args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def condition(kube: MemoryKube, type_: str) -> dict | None:
    return next((c for c in kube.body["status"]["conditions"] if c["type"] == type_), None)


def test_the_pools_get_their_roles_flags_and_bounds_and_the_router_its_pd_flags(tmp_path):
    kube = MemoryKube(copy.deepcopy(SPEC))
    Reconciler(kube).reconcile("ns", "llm")
    prefill = kube.objects[("Deployment", "llm-prefill")]
    decode = kube.objects[("Deployment", "llm")]
    assert prefill["spec"]["replicas"] == 3 and decode["spec"]["replicas"] == 2  # prefill kept within its bounds
    assert prefill["spec"]["selector"]["matchLabels"][ROLE_LABEL] == "prefill"
    assert prefill["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == "prefill"
    assert decode["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == "decode"
    for deployment, role in ((prefill, "prefill"), (decode, "decode")):
        args = args_of(deployment)
        assert args[args.index("--role") + 1] == role and args[args.index("--kv-transfer-port") + 1] == "8100"
        assert args[args.index("--kv-advertise-host") + 1] == "$(POD_IP)"
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    router = args_of(kube.objects[("Deployment", "llm-router")])
    assert router[router.index("--pd-threshold-tokens") + 1] == "512"
    assert router[router.index("--pd-max-prefill-queue") + 1] == "4"
    assert kube.body["status"]["prefillReplicas"] == 1  # MemoryKube's Deployments report one pod

    # what the local pod runtime will run for a prefill pod (its allow-list accepts every flag)
    from iterserve.devcluster.podrunner.launch import build_launch

    pod = {"metadata": {"name": "llm-prefill-x", "namespace": "ns", "uid": "p"},
           "spec": prefill["spec"]["template"]["spec"], "status": {"podIP": "127.10.0.5"}}
    from iterserve.devcluster.podrunner.launch import secret_data

    configmaps = {"llm-engine": {"max_num_seqs": "8"}}
    secrets = {"llm-admin": {"token": "t"}, "llm-kv-auth": secret_data(kube.objects[("Secret", "llm-kv-auth")])}
    launch = build_launch(pod, lambda name, kind: configmaps.get(name), lambda name, kind: secrets.get(name), tmp_path)
    argv = launch.argv
    assert argv[argv.index("--kv-advertise-host") + 1] == "127.10.0.5" and argv[argv.index("--role") + 1] == "prefill"
    # the KV key reaches the process as the Secret's bytes, from a copy in the pod's own folder
    key_file = Path(argv[argv.index("--kv-auth-key-file") + 1])
    assert key_file.is_relative_to(tmp_path)
    assert key_file.read_bytes() == base64.b64decode(kube.objects[("Secret", "llm-kv-auth")]["data"]["key"])


def tick(prompts):
    settings = policy.Settings(warmup_seconds=0, max_replicas=4, spec_max_num_seqs=64)
    decision = policy.decide(settings, policy.State(2, ()), {}, 100)
    return AutoscalerTick(settings, decision, Record(), datetime(2026, 1, 1, tzinfo=UTC), None, prompts)


def test_short_average_prompts_warn_and_long_ones_clear_it():
    kube = MemoryKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    assert condition(kube, "DisaggregationIneffective")["status"] == "Unknown"
    reconciler.reconcile("ns", "llm", tick=tick((120.0, 40)))
    warned = condition(kube, "DisaggregationIneffective")
    assert (warned["status"], warned["reason"]) == ("True", "ShortPrompts")
    assert "120 tokens" in warned["message"] and "spec.disaggregation.thresholdTokens (512)" in warned["message"]
    assert kube.events.count("ShortPrompts") == 1
    reconciler.reconcile("ns", "llm")  # no tick: the last reading stands
    assert condition(kube, "DisaggregationIneffective")["status"] == "True"
    reconciler.reconcile("ns", "llm", tick=tick((2048.0, 50)))
    assert condition(kube, "DisaggregationIneffective")["reason"] == "LongPrompts"


def test_the_average_prompt_sums_tokens_and_requests_over_readable_pods():
    samples = [policy.PodSample("a", 1, prompt_tokens_total=1000, requests_total=10),
               policy.PodSample("b", 1, prompt_tokens_total=3000, requests_total=10),
               policy.PodSample("c", 1, error="timeout"), policy.PodSample("d", 1)]
    assert average_prompt(samples) == (200.0, 20)
    assert average_prompt(samples[2:]) is None


def test_turning_it_off_deletes_the_prefill_pool_and_the_roles():
    kube = MemoryKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.body["spec"]["disaggregation"]["enabled"] = False
    outcome = reconciler.reconcile("ns", "llm")
    assert ("Deployment", "llm-prefill") not in kube.objects
    assert "deleted Deployment llm-prefill (spec.disaggregation.enabled is false)" in outcome.changes
    decode = kube.objects[("Deployment", "llm")]
    assert ROLE_LABEL not in decode["spec"]["template"]["metadata"]["labels"]
    assert "--role" not in args_of(decode)
    assert "--pd-threshold-tokens" not in args_of(kube.objects[("Deployment", "llm-router")])
    assert condition(kube, "DisaggregationIneffective")["reason"] == "Disabled"


@pytest.mark.parametrize("spec, field", [
    ({**SPEC, "routing": {"mode": "None"}}, "spec.disaggregation.enabled: needs spec.routing.mode Router"),
    ({**SPEC, "disaggregation": {"enabled": True, "prefill": {"minReplicas": 3, "maxReplicas": 2}}},
     "spec.disaggregation.prefill.minReplicas: must be <="),
    ({**SPEC, "engine": {"extraArgs": ["--role", "prefill"]}}, "--role is set by the operator"),
    ({**SPEC, "disaggregation": {"enabled": True, "decode": {"extraArgs": ["--tensor-parallel-size", "4"]}}},
     "spec.disaggregation.decode.extraArgs.0.: --tensor-parallel-size is set by the operator"),
    ({**SPEC, "engine": {"parallelism": {"tensor": 4}}, "disaggregation": {"enabled": True, "kvTransferPort": 7998}},
     "spec.disaggregation.kvTransferPort: the KV ports 7998..8001"),
    ({**SPEC, "engine": {"parallelism": {"tensor": 4}}, "disaggregation": {"enabled": True, "kvTransferPort": 65534}},
     "spec.disaggregation.kvTransferPort: 65534 \\+ 4 ranks"),
    # TP=2 x PP=2 is four ranks: 7997..8000 holds the HTTP port (two tensor ranks alone would not)
    ({**SPEC, "engine": {"parallelism": {"tensor": 2, "pipeline": 2}},
      "disaggregation": {"enabled": True, "kvTransferPort": 7997}},
     "spec.disaggregation.kvTransferPort: the KV ports 7997..8000"),
    ({**SPEC, "engine": {"parallelism": {"pipeline": 4}}, "disaggregation": {"enabled": True, "kvTransferPort": 65533}},
     "spec.disaggregation.kvTransferPort: 65533 \\+ 4 ranks"),
])
def test_invalid_combinations_name_the_field(spec, field):
    with pytest.raises(SpecError, match=field.replace("(", r"\(")):
        parse_spec(spec)


def test_tensor_parallel_pools_declare_and_open_one_kv_port_per_rank():
    """Both pools run spec.engine.parallelism, so prefill and decode have one tensor size; tensor
    rank i listens on kvTransferPort + i (engine/kv_transfer/sharded.py)."""
    from iterserve.operator.network_policy import NetworkPolicySettings, build_network_policy
    from iterserve.operator.resources import Owner

    spec = parse_spec({**SPEC, "engine": {"extraArgs": ["--fake-model"], "parallelism": {"tensor": 2}}})
    kube = MemoryKube({**SPEC, "engine": {"extraArgs": ["--fake-model"], "parallelism": {"tensor": 2}}})
    Reconciler(kube).reconcile("ns", "llm")
    for name in ("llm", "llm-prefill"):
        deployment = kube.objects[("Deployment", name)]
        args = args_of(deployment)
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        assert [(p["name"], p["containerPort"]) for p in ports] == [("http", 8000), ("kv-transfer", 8100),
                                                                     ("kv-transfer-1", 8101)]
    policy = build_network_policy(Owner("llm", "ns", "u"), spec, NetworkPolicySettings(enabled=True), {"r": "1"})
    kv = policy["spec"]["ingress"][-1]
    assert kv["ports"] == [{"protocol": "TCP", "port": 8100, "endPort": 8101}]


def test_pipeline_parallel_pools_declare_and_open_one_kv_port_per_rank_of_tensor_x_pipeline():
    """Rank r of TP=2 x PP=2 (stage r // 2, tensor rank r % 2) listens on kvTransferPort + r
    (engine/kv_transfer/sharded.py): both pools run the one parallelism, four ranks each."""
    from iterserve.operator.network_policy import NetworkPolicySettings, build_network_policy
    from iterserve.operator.resources import Owner

    raw = {**SPEC, "engine": {"extraArgs": ["--fake-model"], "parallelism": {"tensor": 2, "pipeline": 2}}}
    kube = MemoryKube(copy.deepcopy(raw))
    Reconciler(kube).reconcile("ns", "llm")
    for name, role in (("llm", "decode"), ("llm-prefill", "prefill")):
        deployment = kube.objects[("Deployment", name)]
        args = args_of(deployment)
        assert args[args.index("--role") + 1] == role
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
        ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        assert [(p["name"], p["containerPort"]) for p in ports] == [
            ("http", 8000), ("kv-transfer", 8100), ("kv-transfer-1", 8101), ("kv-transfer-2", 8102),
            ("kv-transfer-3", 8103)]
    policy = build_network_policy(Owner("llm", "ns", "u"), parse_spec(raw), NetworkPolicySettings(enabled=True),
                                  {"r": "1"})
    assert policy["spec"]["ingress"][-1]["ports"] == [{"protocol": "TCP", "port": 8100, "endPort": 8103}]


def test_port_names_stay_within_kubernetes_fifteen_characters():
    from iterserve.operator.resources import kv_transfer_ports

    spec = parse_spec({**SPEC, "engine": {"parallelism": {"tensor": 64, "pipeline": 16}},
                       "disaggregation": {"enabled": True, "kvTransferPort": 10000}})
    ports = kv_transfer_ports(spec)
    assert [p["containerPort"] for p in ports] == list(range(10000, 11024))
    assert ports[999]["name"] == "kv-transfer-999" and "name" not in ports[1000]  # "kv-transfer-1000" is 16
    assert all(len(p.get("name", "")) <= 15 for p in ports)


def test_nothing_changes_without_disaggregation():
    kube = MemoryKube({"model": {"uri": "m"}})
    Reconciler(kube).reconcile("ns", "llm")
    assert ("Deployment", "llm-prefill") not in kube.objects
    assert condition(kube, "DisaggregationIneffective") is None
    assert routing.router_name("llm") == "llm-router" and disaggregation.prefill_name("llm") == "llm-prefill"
