"""What a step yields for one sequence besides a token: the failure of that request alone.

An executor returns, per scheduled chunk, a sampled token, None (a mid-prompt chunk), or a
RequestFailed when something attributable to that request (sampling it, a logits processor) raised.
The engine then finishes that request with an error and carries on with the others; a fault that
belongs to no single request (the forward pass, the block manager) is raised instead and fails the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestFailed:
    message: str
    # The request field at fault where the request's own input made it fail (a grammar no token of the
    # vocabulary can continue): the server answers 400 naming it; None: the server's fault (500).
    param: str | None = None


StepToken = int | None | RequestFailed
