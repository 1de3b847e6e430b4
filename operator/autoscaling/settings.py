"""The policy's Settings from an InferenceService spec (the pydantic model in operator/models.py)."""

from __future__ import annotations

from iterserve.operator.autoscaling.policy import (
    DirectionRules,
    KvRetuneSettings,
    RatePolicy,
    Settings,
)


def _rules(rules) -> DirectionRules:
    return DirectionRules(
        rules.stabilization_window_seconds,
        tuple(RatePolicy(p.type, p.value, p.period_seconds) for p in rules.policies),
        rules.select_policy,
    )


def settings_from_spec(spec) -> Settings:
    """`spec` is an InferenceServiceSpec; no autoscaling section means mode Off."""
    auto = spec.autoscaling
    if auto is None:
        return Settings(mode="Off", spec_max_num_seqs=spec.engine.max_num_seqs)
    kv = auto.kv_retune
    return Settings(
        mode=auto.mode,
        min_replicas=auto.min_replicas,
        max_replicas=auto.max_replicas,
        target_waiting_per_replica=auto.target_waiting_per_replica,
        preemptions_per_minute_threshold=auto.preemptions_per_minute_threshold,
        tolerance=auto.tolerance,
        scale_up=_rules(auto.scale_up),
        scale_down=_rules(auto.scale_down),
        cold_start_seconds=auto.cold_start_seconds,
        warmup_seconds=auto.warmup_seconds,
        stale_sample_seconds=max(60, 4 * auto.interval_seconds),
        spec_max_num_seqs=spec.engine.max_num_seqs,
        kv_retune=KvRetuneSettings(
            enabled=kv.enabled, threshold=kv.threshold, consecutive_samples=kv.consecutive_samples,
            step_factor=kv.step_factor, floor=kv.floor, recovery_threshold=kv.recovery_threshold,
            recovery_window_seconds=kv.recovery_window_seconds, recovery_step=kv.recovery_step,
        ),
    )
