"""SLO mode's mean prompt and output lengths count the requests still running at the window's
edges: the token counters grow with running requests while the request counter counts finished
ones only, so dividing by the finished requests alone read a rising load's lengths three times
too long (and a falling one's a third as long), and planned replicas for the wrong workload."""

from __future__ import annotations

import pytest

from iterserve.operator.autoscaling.policy import PodSample
from iterserve.operator.autoscaling.slo import measure_workload
from tests.unit.test_autoscaling_slo import NOW, ready, settings_for, spec

PROMPT, OUTPUT, WINDOW = 64, 32, 120


def _pod(finished_from: float, finished_to: float, running_from: float, running_to: float) -> list[PodSample]:
    """Readings every 15 s over the window of a pod whose finished requests and running ones move
    linearly between the given counts; every request has PROMPT and OUTPUT tokens, and a running
    one is halfway through its output (so the counters read what a real engine's would)."""
    out = []
    steps = 8
    for i in range(steps + 1):
        finished = finished_from + (finished_to - finished_from) * i / steps
        running = running_from + (running_to - running_from) * i / steps
        out.append(PodSample("a", NOW - WINDOW + 15 * i, 0.0, running, 0.1, 0.0, 8.0,
                             prompt_tokens_total=(finished + running) * PROMPT, requests_total=finished,
                             generation_tokens_total=finished * OUTPUT + running * OUTPUT / 2))
    return out


@pytest.mark.parametrize("finished_to,running_from,running_to,finished_only", [
    (104, 0, 8, (3.0, 2.0)),  # a rising load: 4 finished, 8 more running at the end than at the start
    (112, 8, 0, (1 / 3, 2 / 3)),  # a falling one: 12 finished, 8 of them running at the start
    (160, 6, 6, (1.0, 1.0)),  # steady: the edges cancel either way
])
def test_mean_lengths_count_the_requests_running_at_the_windows_edges(finished_to, running_from, running_to,
                                                                      finished_only):
    s = spec({"ttftP95Ms": 500, "window": WINDOW}, warmupSeconds=0)
    settings = settings_for(s)
    history = {"a": _pod(100, finished_to, running_from, running_to)}
    workload = measure_workload(settings.slo, ["a"], {"a": ready("a")}, history, settings, NOW)
    assert workload.prompt_tokens == pytest.approx(PROMPT) and workload.output_tokens == pytest.approx(OUTPUT)
    # What dividing by the finished requests alone read from the same counters.
    first, last = history["a"][0], history["a"][-1]
    finished = last.requests_total - first.requests_total
    read_before = ((last.prompt_tokens_total - first.prompt_tokens_total) / finished / PROMPT,
                   (last.generation_tokens_total - first.generation_tokens_total) / finished / OUTPUT)
    assert read_before == pytest.approx(finished_only)
