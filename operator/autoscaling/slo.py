"""SLO mode's reading, pure: the measured workload and p95s of the decode pool's warm pods over
the window, the simulator's replica model run on that workload (iterserve/replica_model/plan.py, the
one implementation the simulator also runs), and what it proposes.

Rules, in order:
  - Workload: the arrival rate is the finished-request rate plus the growth of requests in the
    pods (waiting + running), over each warm pod's samples in the window (samples from pods still
    warming are left out, as everywhere in the policy); mean prompt and output lengths from the
    token counters, counting the requests still running at the window's edges (`_mean_lengths`).
    A pod counts once its warm readings cover MIN_SPAN_FRACTION of the window (a
    pod just past its warm-up has seconds of readings, and a rate or a mean length over two or
    three seconds is noise: in the whole loop, 2 requests over 3 s read as 1.3 req/s at twice the
    real lengths and scaled a lightly loaded pool up); the others are assumed to take the same
    share of the load as the counted ones (the router spreads it). No pod counted, or no
    counter: no estimate (fallback to the waiting-requests signal).
  - Prediction check: with at least MIN_OBSERVED requests measured in the window, the prediction
    for the current replicas and max_num_seqs is compared with the measured p95s; an error above
    slo.maxPredictionError (|predicted - measured| / measured) falls back to the waiting-requests
    signal, and the decision says so.
  - Plan: the fewest replicas whose predicted p95s meet the targets (scale up to it), and the
    fewest that meet targets x (1 - hysteresis) (scale down only to it): between the two the
    replicas stay, which is the band that stops 2 <-> 1 flapping. With an ITL target, each
    replica count is tried at the spec's max_num_seqs and halvings of it to the KV retune's
    floor; the largest that meets the ITL target at the planned replicas is the cap the pods get
    when it is below the spec's.
  - Profile: the replica model steps in `settings.slo.profile`, the spec's stepProfile or, once
    the InferenceService's online fit takes over, that fit (the loop puts it in the settings:
    step_feed.py); every outcome names it and says why (`profile_choice`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from iterserve.operator.autoscaling.readings import (
    PodSample,
    PodState,
    counter_increase,
    usable_samples,
    windowed_quantile,
)
from iterserve.operator.autoscaling.settings import Settings, SloSettings
from iterserve.replica_model.online import ProfileChoice
from iterserve.replica_model.plan import Plan, Prediction, Workload, plan, predict

MIN_OBSERVED = 20  # requests in the window before a measured p95 can overrule the prediction
MIN_SPAN_FRACTION = 0.5  # of the window: a pod's warm readings must cover this much to count
SLO_SIGNAL = "SLO"


@dataclass(frozen=True)
class SloOutcome:
    """What SLO mode made of this tick (status.slo and the decision's message)."""

    workload: Workload | None
    measured_ttft_p95_s: float | None
    measured_itl_p95_s: float | None
    observed: int  # requests whose first token fell in the window (warm pods)
    predicted_current: Prediction | None  # at the current replicas and max_num_seqs
    up: Plan | None  # the fewest replicas meeting the targets
    down: Plan | None  # the fewest meeting targets x (1 - hysteresis)
    prediction_error: float | None
    fallback: bool
    proposal: int | None  # None: fall back to the waiting-requests signal
    max_num_seqs: int | None  # the ITL target's cap when it binds, else None
    reason: str  # snake_case
    note: str
    step_profile: str = ""  # the profile's name the prediction ran
    profile_choice: ProfileChoice = ProfileChoice()  # which profile, and why (online fit or given)

    @property
    def predicted(self) -> Prediction | None:
        """The prediction at the replicas proposed."""
        if self.proposal is None:
            return None
        for candidate in (self.down, self.up):
            if candidate is not None and candidate.replicas == self.proposal:
                return candidate.prediction
        return self.predicted_current


def measure_workload(slo: SloSettings, measured: Sequence[str], pods: Mapping[str, PodState],
                     history: Mapping[str, Sequence[PodSample]], settings: Settings,
                     now: float) -> Workload | None:
    """The pool's workload over the window from its measured (warm) pods whose readings cover
    enough of it; None when no pod does, or one lacks the counters."""
    rate = prompt = output = finished = running_growth = 0.0
    counted = 0
    for name in measured:
        samples = usable_samples(history.get(name, ()), pods[name], settings)
        requests = counter_increase(samples, "requests_total", now, slo.window_seconds)
        if requests is None and len([s for s in samples if s.ok]) >= 2:
            return None  # readings, but no request counter
        if requests is None or requests[1] < MIN_SPAN_FRACTION * slo.window_seconds:
            continue  # too short a history yet
        count, seconds = requests
        prompts = counter_increase(samples, "prompt_tokens_total", now, slo.window_seconds)
        outputs = counter_increase(samples, "generation_tokens_total", now, slo.window_seconds)
        if prompts is None or outputs is None:
            return None
        # Requests in the pods at the span's start and end (the same readings as the counter's).
        readings = [s for s in samples if s.ok and s.waiting is not None and s.running is not None]
        inside = [s for s in readings if s.at >= readings[-1].at - seconds - 1e-9] if readings else []
        growth = 0.0
        if len(inside) >= 2:
            growth = (inside[-1].waiting + inside[-1].running) - (inside[0].waiting + inside[0].running)
            running_growth += inside[-1].running - inside[0].running
        rate += max(0.0, count + growth) / seconds
        prompt += prompts[0]
        output += outputs[0]
        finished += count
        counted += 1
    if not counted:
        return None
    rate *= len(measured) / counted
    return Workload(rate, *_mean_lengths(prompt, output, finished, running_growth))


def _mean_lengths(prompt: float, output: float, finished: float, running_growth: float) -> tuple[float, float]:
    """Mean prompt and output tokens per request from the window's counter increases. The token
    counters count requests still running too (a prompt once its first token is out, each output
    token as it comes) while the request counter counts finished ones only, so dividing by the
    finished requests alone reads a rising load's lengths long and a falling one's short. The
    prompts counted belong to the requests that started: those that finished plus the growth of
    those running. The output tokens counted are, in expectation, the finished requests' whole
    outputs plus half an output for each request more running at the end than at the start (one
    running at an edge is halfway through, on average). Nothing to divide by: 1 token each."""
    started = finished + running_growth
    halfway = finished + running_growth / 2
    return (prompt / started if started > 0 and prompt > 0 else 1.0,
            output / halfway if halfway > 0 and output > 0 else 1.0)


def slo_reading(settings: Settings, current: int, seqs_now: int, measured: Sequence[str],
                pods: Mapping[str, PodState], history: Mapping[str, Sequence[PodSample]],
                now: float) -> SloOutcome:
    """The tick's SLO outcome; it names the step profile it ran and why that one."""
    outcome = _slo_reading(settings, current, seqs_now, measured, pods, history, now)
    slo = settings.slo
    return replace(outcome, step_profile=slo.profile.name, profile_choice=slo.profile_choice,
                   note=f"{outcome.note}; step profile {slo.profile.name} ({slo.profile_choice.describe()})")


def _slo_reading(settings: Settings, current: int, seqs_now: int, measured: Sequence[str],
                 pods: Mapping[str, PodState], history: Mapping[str, Sequence[PodSample]],
                 now: float) -> SloOutcome:
    slo = settings.slo
    histories = [usable_samples(history.get(name, ()), pods[name], settings) for name in measured]
    ttft, observed = windowed_quantile(0.95, histories, now, slo.window_seconds, "ttft_buckets")
    itl, _ = windowed_quantile(0.95, histories, now, slo.window_seconds, "itl_buckets")
    workload = measure_workload(slo, measured, pods, history, settings, now)
    if workload is None:
        return SloOutcome(None, ttft, itl, observed, None, None, None, None, True, None, None, "slo_fallback_queue",
                          "SLO mode: no warm pod has request and token counters (llm_requests_total, "
                          "llm_prompt_tokens_total, llm_generation_tokens_total) over "
                          f"{MIN_SPAN_FRACTION * slo.window_seconds:g} s of the window yet: waiting-requests signal")
    targets = _targets(slo)
    if workload.arrival_rate <= 0:
        return SloOutcome(workload, ttft, itl, observed, None, None, None, None, False, settings.min_replicas,
                          None, "slo_no_traffic", f"SLO mode: no requests in {slo.window_seconds:g} s")

    current_prediction = predict(slo.engine, slo.server, slo.profile, workload, max(1, current), seqs_now)
    error = _prediction_error(current_prediction, ttft, itl, observed, slo)
    workload_note = (f"{workload.arrival_rate:.3g} req/s, prompt {workload.prompt_tokens:.0f}, "
                     f"output {workload.output_tokens:.0f} tokens")
    measured_note = f"measured p95 TTFT {_ms(ttft)}, ITL {_ms(itl)} over {observed} requests"
    if error is not None and error > slo.max_prediction_error:
        return SloOutcome(workload, ttft, itl, observed, current_prediction, None, None, error, True, None, None,
                          "slo_fallback_queue",
                          f"SLO mode: prediction off by {error:.0%} (> {slo.max_prediction_error:.0%}: predicted "
                          f"TTFT {_ms(current_prediction.ttft_p95_s)}, ITL {_ms(current_prediction.itl_p95_s)}; "
                          f"{measured_note}): waiting-requests signal")

    floor = settings.kv_retune.floor
    bounds = (settings.min_replicas, settings.max_replicas)
    up = plan(slo.engine, slo.server, slo.profile, workload, *bounds, *targets, 1.0, floor)
    down = plan(slo.engine, slo.server, slo.profile, workload, *bounds, *targets, 1.0 - slo.hysteresis, floor)
    if up.replicas > current:
        proposal, reason = up.replicas, "slo_predicted_miss"
    elif down.replicas < current:
        proposal, reason = down.replicas, "slo_met_with_fewer"
    else:
        proposal, reason = current, "within_slo_band"
    chosen = up if proposal == up.replicas else down if proposal == down.replicas else None
    seqs = chosen.max_num_seqs if chosen is not None else _seqs_at(slo, workload, current, floor, targets)
    cap = seqs if slo.itl_p95_s is not None and seqs < slo.engine.max_num_seqs else None
    if not up.met:
        reason = "slo_unreachable" if proposal >= current else reason
    predicted = chosen.prediction if chosen is not None else current_prediction
    note = (f"SLO mode: {workload_note}; predicted at {proposal} replicas p95 TTFT {_ms(predicted.ttft_p95_s)}, "
            f"ITL {_ms(predicted.itl_p95_s)} (targets {_ms(slo.ttft_p95_s)}, {_ms(slo.itl_p95_s)}; "
            f"{up.replicas} meet them, {down.replicas} meet them with {slo.hysteresis:.0%} headroom"
            f"{'' if up.met else '; none up to maxReplicas does'}); {measured_note}"
            + (f"; ITL target caps max_num_seqs at {cap}" if cap is not None else ""))
    return SloOutcome(workload, ttft, itl, observed, current_prediction, up, down, error, False, proposal, cap,
                      reason, note)


def _targets(slo: SloSettings) -> tuple[float | None, float | None]:
    return slo.ttft_p95_s, slo.itl_p95_s


def _seqs_at(slo: SloSettings, workload: Workload, replicas: int, floor: int, targets) -> int:
    """The largest max_num_seqs meeting the ITL target at `replicas` (within the band)."""
    found = plan(slo.engine, slo.server, slo.profile, workload, replicas, replicas, *targets, 1.0, floor)
    return found.max_num_seqs


def _prediction_error(prediction: Prediction, ttft: float | None, itl: float | None, observed: int,
                      slo: SloSettings) -> float | None:
    if observed < MIN_OBSERVED:
        return None
    errors = []
    if slo.ttft_p95_s is not None and ttft:
        errors.append(abs(prediction.ttft_p95_s - ttft) / ttft)
    if slo.itl_p95_s is not None and itl:
        errors.append(abs(prediction.itl_p95_s - itl) / itl)
    return max(errors) if errors else None


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    if math.isinf(seconds):
        return "unbounded"
    return f"{seconds * 1000:.0f} ms"
