"""InferenceService models: defaulting, validation with field names, the examples."""

from pathlib import Path

import pytest
import yaml

from iterserve.operator.models import InferenceService, InferenceServiceSpec
from iterserve.operator.validation import SpecError, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_minimal_spec_gets_the_documented_defaults():
    spec = parse_spec({"model": {"uri": "smollm2-135m"}})
    assert spec.replicas == 1
    assert spec.engine.max_num_seqs == 64 and spec.engine.block_size == 16
    assert spec.engine.chunked_prefill is True and spec.engine.preemption_mode == "recompute"
    assert spec.autoscaling is None and spec.autoscaling_mode == "Off"


def test_autoscaling_defaults_follow_the_design_note_and_hpa():
    scaling = parse_spec({"model": {"uri": "m"}, "autoscaling": {}}).autoscaling
    assert scaling.mode == "Builtin"
    assert scaling.preemptions_per_minute_threshold == 1
    assert scaling.scale_up.stabilization_window_seconds == 0
    assert scaling.scale_down.stabilization_window_seconds == 300
    assert scaling.kv_retune.threshold == 0.95
    assert scaling.kv_retune.step_factor == 0.75
    assert scaling.kv_retune.recovery_threshold == 0.80
    assert scaling.interval_seconds == 15 and scaling.metrics_source == "scrape"


@pytest.mark.parametrize("spec, field", [
    ({}, "spec.model"),
    ({"model": {"uri": ""}}, "spec.model.uri"),
    ({"model": {"uri": "m"}, "replicas": -1}, "spec.replicas"),
    ({"model": {"uri": "m"}, "engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ({"model": {"uri": "m"}, "engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"model": {"uri": "m"}, "engine": {"preemptionMode": "drop"}}, "spec.engine.preemptionMode"),
    ({"model": {"uri": "m"}, "engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
    ({"model": {"uri": "m"}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "spec.engine.maxNumSeqs"),
    ({"model": {"uri": "m"}, "engine": {"chunkedPrefill": False, "maxNumBatchedTokens": 512, "maxModelLen": 2048}},
     "spec.engine.maxNumBatchedTokens"),
    ({"model": {"uri": "m"}, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"model": {"uri": "m"}, "autoscaling": {"mode": "Auto"}}, "spec.autoscaling.mode"),
    ({"model": {"uri": "m"}, "autoscaling": {"kvRetune": {"threshold": 1.5}}}, "spec.autoscaling.kvRetune.threshold"),
    ({"model": {"uri": "m"}, "autoscaling": {"kvRetune": {"threshold": 0.7}}},
     "spec.autoscaling.kvRetune.recoveryThreshold"),
    ({"model": {"uri": "m"}, "engine": {"maxNumSeqs": 4}, "autoscaling": {"kvRetune": {"floor": 8}}},
     "spec.autoscaling.kvRetune.floor"),
    ({"model": {"uri": "m"}, "engine": {"extraArgs": ["--seed", "1", "--max-num-seqs=9"]}}, "spec.engine.extraArgs[2]"),
    ({"model": {"uri": "m"}, "engine": {"env": [{"name": "ITERSERVE_ADMIN_TOKEN", "value": "x"}]}},
     "spec.engine.env[0].name"),
    ({"model": {"uri": "m"}, "podTemplatePatch": {"kind": "Pod"}}, "spec.podTemplatePatch"),
    ({"model": {"uri": "m"}, "engine": {"maxNumSeq": 4}}, "spec.engine.maxNumSeq"),
    ({"model": {"uri": "m", "persistentVolumeClaim": {"claimName": "a"}, "volume": {"emptyDir": {}}}}, "spec.model"),
])
def test_invalid_specs_name_the_field(spec, field):
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert caught.value.field == field, str(caught.value)
    assert str(caught.value).startswith(field)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_inference_services(path):
    doc = yaml.safe_load(path.read_text())
    service = InferenceService.model_validate(doc)
    parse_spec(doc["spec"])
    assert service.metadata["name"]


def test_wire_form_round_trips():
    spec = parse_spec(yaml.safe_load((EXAMPLES / "gpu-autoscaling.yaml").read_text())["spec"])
    again = InferenceServiceSpec.model_validate(spec.to_wire())
    assert again == spec
    assert "maxNumSeqs" in spec.to_wire()["engine"]
