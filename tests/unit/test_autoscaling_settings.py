"""The policy's settings come from the InferenceService spec models, defaults included."""

from iterserve.operator.autoscaling.policy import RatePolicy
from iterserve.operator.autoscaling.settings import settings_from_spec
from iterserve.operator.models import InferenceServiceSpec


def test_settings_from_the_spec_models():
    spec = InferenceServiceSpec.model_validate({
        "model": {"uri": "smollm2-135m"}, "engine": {"maxNumSeqs": 24},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 5, "targetWaitingPerReplica": 3,
                        "scaleDown": {"stabilizationWindowSeconds": 20},
                        "kvRetune": {"threshold": 0.9, "floor": 4}},
    })
    settings = settings_from_spec(spec)
    assert (settings.mode, settings.min_replicas, settings.max_replicas) == ("Builtin", 2, 5)
    assert settings.target_waiting_per_replica == 3 and settings.spec_max_num_seqs == 24
    assert settings.scale_down.stabilization_window_seconds == 20
    assert settings.scale_up.policies == (RatePolicy("Pods", 4, 15), RatePolicy("Percent", 100, 15))
    assert (settings.kv_retune.threshold, settings.kv_retune.floor) == (0.9, 4)
    off = settings_from_spec(InferenceServiceSpec.model_validate({"model": {"uri": "x"}}))
    assert off.mode == "Off"
