"""operator/routing.py's builders per spec.routing.mode, and the engine metrics an unmodified
Gateway API Inference Extension endpoint picker reads."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine.llm_engine import EngineStats
from iterserve.engine.server.metrics import ServerMetrics
from iterserve.operator import routing
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.resources import ENGINE_PORT, Owner, selector_labels

OWNER = Owner("chat", "team-a", "uid-1")


def spec(mode: str | None = None, **routing_fields) -> InferenceServiceSpec:
    body = {"model": {"uri": "smollm2-135m"}}
    if mode is not None:
        body["routing"] = {"mode": mode, **routing_fields}
    return InferenceServiceSpec.model_validate(body)


def test_router_is_the_default_and_gets_pod_reading_rights_in_its_namespace_only():
    s = spec()
    assert s.routing.mode == routing.ROUTER
    objects = {o["kind"]: o for o in routing.build_routing(OWNER, s)}
    assert set(objects) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget"}
    assert objects["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},  # the controller chain
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"], "resourceNames": ["chat", "chat-prefill"]},
        # multi-node groups' chain: StatefulSets, their ControllerRevisions, the LeaderWorkerSets
        {"apiGroups": ["apps"], "resources": ["statefulsets", "controllerrevisions"], "verbs": ["list"]},
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get"],
         "resourceNames": ["chat", "chat-prefill"]}]
    assert all(o["metadata"]["namespace"] == "team-a" for o in objects.values())
    assert objects["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "team-a"}]
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "chat-router"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["iterserve", "router"]
    assert container["args"][:4] == ["--infsvc", "chat", "-n", "team-a"]
    # The InferenceService's Service selects the router pods; the router's selector is not the engines'.
    assert routing.service_selector("chat", s) == deployment["spec"]["selector"]["matchLabels"]
    assert routing.service_selector("chat", s) != selector_labels("chat")


def test_the_router_survives_drains_and_stops_without_cutting_streams():
    objects = {o["kind"]: o for o in routing.build_routing(OWNER, spec())}
    deployment, budget = objects["Deployment"], objects["PodDisruptionBudget"]
    assert deployment["spec"]["replicas"] == 2
    assert budget["spec"] == {"minAvailable": 1, "selector": deployment["spec"]["selector"]}
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    args = container["args"]
    drain = float(args[args.index("--drain-grace") + 1])
    # SIGKILL comes only after the preStop sleep and the whole drain, with room for shutdown.
    assert pod["terminationGracePeriodSeconds"] > sleep + drain


def test_router_args_parse_with_the_router_cli():
    import argparse

    from iterserve.router.cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(routing.router_args(OWNER))
    assert (args.infsvc, args.namespace, args.host, args.port) == ("chat", "team-a", "0.0.0.0", routing.ROUTER_PORT)


def test_gateway_renders_an_inference_pool_with_fail_open_picker():
    s = spec("Gateway")
    (pool,) = routing.build_routing(OWNER, s)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["selector"] == {"matchLabels": selector_labels("chat")}
    assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen" and ref["kind"] == "Service" and ref["name"] == "chat-epp"
    assert routing.engine_pod_labels(s) == {routing.ENGINE_TYPE_LABEL: "vllm"}
    assert routing.service_selector("chat", s) == selector_labels("chat")
    assert routing.build_routing(OWNER, spec("Gateway", endpointPicker="my-epp"))[0]["spec"]["endpointPickerRef"]["name"] == "my-epp"


def test_none_adds_nothing():
    s = spec("None")
    assert routing.build_routing(OWNER, s) == [] and routing.engine_pod_labels(s) == {}
    assert routing.service_selector("chat", s) == selector_labels("chat")


def test_mode_is_validated():
    with pytest.raises(ValueError):
        spec("RoundRobin")


def test_engine_metrics_have_exactly_one_series_per_endpoint_picker_gauge():
    stats = EngineStats(num_waiting=3, num_running=5, num_swapped=0, kv_usage=0.25, num_preemptions=1,
                        max_num_seqs=8, num_kv_blocks=100, block_size=16, num_steps=10)
    text = ServerMetrics("smollm2-135m", lambda: stats).exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in routing.ENDPOINT_PICKER_GAUGES:
        assert families[name].type == "gauge", name
        assert len(families[name].samples) == 1, (name, families[name].samples)
    value = {name: families[name].samples[0].value for name in routing.ENDPOINT_PICKER_GAUGES}
    assert value == {"vllm:num_requests_waiting": 3, "vllm:num_requests_running": 5, "vllm:kv_cache_usage_perc": 0.25}
