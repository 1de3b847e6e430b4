"""The pod status the local runtime writes, as a kubelet would: phase, the Ready and
ContainersReady conditions (with transition times), and the one container's status.
PodScheduled, hostIP and podIP are left as the scheduler and KWOK wrote them."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.devcluster.podrunner.process import now_iso


@dataclass
class ContainerView:
    """What the worker knows about its container right now."""

    name: str
    image: str
    running_since: str | None = None  # RFC 3339 start of the running process
    waiting_reason: str | None = None  # ContainerCreating, CrashLoopBackOff, CreateContainerConfigError...
    waiting_message: str = ""
    terminated: dict | None = None  # the current state when it exited and will not restart
    last_terminated: dict | None = None  # lastState.terminated after a restart
    restart_count: int = 0
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    pid: int | None = None


@dataclass
class StatusWriter:
    """Keeps condition transition times and tells whether anything changed since the last write."""

    start_time: str | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, time)
    last_written: dict | None = None

    def _condition(self, kind: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != status:
            self.transitions[kind] = (status, now_iso())
        condition = {"type": kind, "status": status, "lastTransitionTime": self.transitions[kind][1],
                     "reason": None, "message": None}  # null: a strategic merge patch drops stale ones
        if not ok and kind in ("Ready", "ContainersReady"):
            condition.update(reason="ContainersNotReady", message="containers with unready status: [engine]")
        return condition

    def build(self, container: ContainerView, phase: str) -> dict:
        if self.start_time is None:
            self.start_time = now_iso()
        state: dict
        if container.running_since:
            state = {"running": {"startedAt": container.running_since}}
        elif container.terminated:
            state = {"terminated": container.terminated}
        else:
            waiting = {"reason": container.waiting_reason or "ContainerCreating"}
            if container.waiting_message:
                waiting["message"] = container.waiting_message
            state = {"waiting": waiting}
        status_entry = {
            "name": container.name, "image": container.image, "imageID": "",
            "containerID": f"local://{container.pid}" if container.pid else "",
            "ready": container.ready, "started": container.started,
            "restartCount": container.restart_count, "state": state,
            "lastState": {"terminated": container.last_terminated} if container.last_terminated else {},
        }
        return {
            "phase": phase,
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", True),
                self._condition("ContainersReady", container.ready),
                self._condition("Ready", container.ready),
            ],
            "containerStatuses": [status_entry],
        }

    def changed(self, status: dict, observed: dict | None = None) -> bool:
        """Differs from what was last written, or the API holds something else for what this
        writes (the node lifecycle controller marks pods unready when their node goes NotReady;
        a kubelet puts its own view back at its next status sync, and so does this)."""
        if status != self.last_written:
            return True
        if observed is None:
            return False
        seen = {c.get("type"): c.get("status") for c in observed.get("conditions") or []}
        ours = {c["type"]: c["status"] for c in status["conditions"]}
        return observed.get("phase") != status["phase"] or any(seen.get(k) != v for k, v in ours.items())
