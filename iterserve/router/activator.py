"""The activator: while no replica is routable (an InferenceService scaled to zero, or its only
replica still starting), the router holds requests instead of answering 503 at once, and sends
each on as soon as a replica is Ready; a streamed answer's first byte reaches the client only
then. Holding is bounded twice: at most `max_held` requests at a time (one more gets 503 with
Retry-After at once) and at most `hold_timeout_s` each (then 503 with Retry-After). Both 503s
carry OpenAI's error JSON.

The held count is the router's `iterserve_router_held_requests` gauge: the operator's autoscaler
reads it from the router pods (operator/autoscaling/router_source.py) and brings a pool at zero
back to one replica, so the router asks for capacity without any write to the API server.

In: `hold()` from the request path when picking finds no routable replica. Out: whether the
request may try to pick again, or the answer to send. The waiting itself is on the router's
"endpoints changed" event (proxy.py), which every scrape and endpoint change sets.
"""

from __future__ import annotations

from dataclasses import dataclass

HELD_OUTCOMES = ("forwarded", "timed_out", "refused_full")  # iterserve_router_holds_total's label


@dataclass(frozen=True)
class ActivatorOptions:
    hold_timeout_s: float = 0.0  # 0: off (503 at once while no replica is routable)
    max_held: int = 100  # requests held at once; one more is refused at once

    @property
    def enabled(self) -> bool:
        return self.hold_timeout_s > 0


class Activator:
    """The held-request count and its bound; the proxy waits, this keeps the books."""

    def __init__(self, options: ActivatorOptions):
        self.options = options
        self.held = 0

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def take(self) -> bool:
        """One more request held; False when the bound is reached (refuse it)."""
        if self.held >= self.options.max_held:
            return False
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1

    def timeout_message(self) -> str:
        return (f"no replica became ready within {self.options.hold_timeout_s:g} s (the router held the request: "
                "--hold-timeout); retry later")

    def full_message(self) -> str:
        return (f"no replica is ready and the router already holds {self.options.max_held} requests "
                "(--hold-max); retry later")
