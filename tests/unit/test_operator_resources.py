"""Spec -> Deployment, Service, ConfigMap, Secret builders."""

from pathlib import Path

import yaml

from iterserve.operator import resources as r
from iterserve.operator.validation import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OWNER = r.Owner("llm", "team-a", "uid-123")


def example_spec(name: str):
    return parse_spec(yaml.safe_load((EXAMPLES / name).read_text())["spec"])


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args, name):
    return args[args.index(name) + 1]


def test_every_object_is_owned_and_labelled():
    spec = example_spec("minimal.yaml")
    objects = [r.build_deployment(OWNER, spec), r.build_service(OWNER, spec),
               r.build_configmap(OWNER, spec, 16), r.build_admin_secret(OWNER)]
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService",
                                            "name": "llm", "uid": "uid-123", "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/instance"] == "llm"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "iterserve-operator"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "iterserve"


def test_engine_command_carries_the_spec():
    spec = parse_spec({"model": {"uri": "m.gguf", "persistentVolumeClaim": {"claimName": "models"}},
                       "engine": {"maxNumSeqs": 32, "maxNumBatchedTokens": 4096, "maxModelLen": 4096,
                                  "blockSize": 32, "chunkedPrefill": False, "preemptionMode": "swap",
                                  "kvCacheMemory": "2GiB", "extraArgs": ["--seed", "7"]}})
    c = container(r.build_deployment(OWNER, spec))
    assert c["command"] == ["iterserve", "serve"]
    args = c["args"]
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"
    assert flag(args, "--model") == "/models/m.gguf"
    assert flag(args, "--max-num-seqs") == "$(ITERSERVE_MAX_NUM_SEQS)"
    assert flag(args, "--max-num-batched-tokens") == "4096" and flag(args, "--max-model-len") == "4096"
    assert flag(args, "--block-size") == "32" and flag(args, "--preemption-mode") == "swap"
    assert flag(args, "--kv-cache-memory") == "2GiB" and "--no-chunked-prefill" in args
    assert args[-2:] == ["--seed", "7"]
    env = {e["name"]: e for e in c["env"]}
    assert env["ITERSERVE_MAX_NUM_SEQS"]["valueFrom"]["configMapKeyRef"] == {"name": "llm-engine", "key": "max_num_seqs"}
    assert env["ITERSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "llm-admin", "key": "token"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    volumes = {v["name"]: v for v in r.build_deployment(OWNER, spec)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_embedded_model_without_volume_is_passed_as_is():
    args = container(r.build_deployment(OWNER, example_spec("minimal.yaml")))["args"]
    assert flag(args, "--model") == "smollm2-135m" and "--no-chunked-prefill" not in args


def test_probes_drain_and_grace_period_match():
    spec = parse_spec({"model": {"uri": "m"}, "engine": {"drainSeconds": 45, "startupSeconds": 900}})
    pod = r.build_deployment(OWNER, spec)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    # preStop waits for endpoint removal; SIGTERM then makes the engine drain for --drain-timeout
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert flag(c["args"], "--drain-timeout") == "45"
    assert pod["terminationGracePeriodSeconds"] >= sleep + 45 + 5


def test_restricted_security_context():
    pod = r.build_deployment(OWNER, example_spec("minimal.yaml"))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = pod["containers"][0]["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]


def test_gpus_requested_and_tolerated():
    deployment = r.build_deployment(OWNER, example_spec("gpu-autoscaling.yaml"))
    pod = deployment["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "1" and res["requests"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert deployment["spec"]["replicas"] == 2
    # GPU only in requests still ends up in limits, where the scheduler needs it
    spec = parse_spec({"model": {"uri": "m"}, "engine": {"resources": {"requests": {"nvidia.com/gpu": 2}}}})
    assert r.container_resources(spec)["limits"] == {"nvidia.com/gpu": "2"}


def test_cpu_only_pods_have_no_gpu_toleration():
    pod = r.build_deployment(OWNER, example_spec("minimal.yaml"))["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nvidia.com/gpu" not in str(pod["containers"][0].get("resources"))


def test_scrape_annotations_and_selector():
    deployment = r.build_deployment(OWNER, example_spec("minimal.yaml"))
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert r.selector_string("llm") == "app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance=llm"


def test_service_has_http_and_metrics_ports():
    service = r.build_service(OWNER, example_spec("minimal.yaml"))
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "metrics": 9090}
    assert service["spec"]["selector"] == r.selector_labels("llm")


def test_configmap_holds_the_effective_max_num_seqs():
    spec = example_spec("gpu-autoscaling.yaml")
    cm = r.build_configmap(OWNER, spec, r.effective_max_num_seqs(spec, 96))
    assert cm["data"] == {"max_num_seqs": "96"}  # nothing else: the engine reads only this
    assert r.effective_max_num_seqs(spec, None) == 128
    assert r.effective_max_num_seqs(spec, 500) == 128  # never above the spec


def test_retune_changes_only_the_configmap_not_the_pod_template():
    spec = example_spec("gpu-autoscaling.yaml")
    tuned = {o["kind"]: o for o in r.build_owned(OWNER, spec, 96)}
    retuned = {o["kind"]: o for o in r.build_owned(OWNER, spec, 72)}
    assert tuned["Deployment"] == retuned["Deployment"] and tuned["Service"] == retuned["Service"]
    assert tuned["ConfigMap"] != retuned["ConfigMap"]
    raised = parse_spec({**spec.to_wire(), "engine": {**spec.to_wire()["engine"], "maxNumSeqs": 256}})
    assert (r.build_deployment(OWNER, raised)["spec"]["template"]
            != r.build_deployment(OWNER, spec)["spec"]["template"])


def test_pod_template_patch_merges_named_lists():
    spec = parse_spec({"model": {"uri": "m"}, "podTemplatePatch": {
        "metadata": {"labels": {"team": "a", "app.kubernetes.io/instance": "hijack"}},
        "spec": {"containers": [{"name": "engine", "env": [{"name": "X", "value": "1"}]},
                                {"name": "sidecar", "image": "busybox"}],
                 "runtimeClassName": "nvidia", "enableServiceLinks": None}}}, frozenset({"runtimeClass=nvidia"}))
    template = r.build_deployment(OWNER, spec)["spec"]["template"]
    names = [c["name"] for c in template["spec"]["containers"]]
    assert names == ["engine", "sidecar"]
    engine_env = [e["name"] for e in template["spec"]["containers"][0]["env"]]
    assert "ITERSERVE_MAX_NUM_SEQS" in engine_env and "X" in engine_env
    assert template["spec"]["runtimeClassName"] == "nvidia"
    assert "enableServiceLinks" not in template["spec"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"  # the selector still matches


def test_admin_secret_token_is_random():
    a, b = r.build_admin_secret(OWNER), r.build_admin_secret(OWNER)
    assert a["stringData"]["token"] != b["stringData"]["token"] and len(a["stringData"]["token"]) >= 32
