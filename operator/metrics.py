"""The operator's own Prometheus metrics: the reconcile's (module-level, in the default registry)
and the autoscaler's (`OperatorMetrics`, one instance per operator process). Every name lives in
iterserve.engine.metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from iterserve.engine import metrics as names

if TYPE_CHECKING:
    from iterserve.operator.autoscaling.policy import Decision
    from iterserve.operator.autoscaling.settings import Settings

RECONCILES = Counter(
    names.OPERATOR_RECONCILES_TOTAL.removesuffix("_total"),
    "InferenceService reconciles by result (applied, unchanged, invalid, conflict, gone, error)", ["result"])
RECONCILE_SECONDS = Histogram(
    names.OPERATOR_RECONCILE_SECONDS, "Time one reconcile takes",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
OBJECT_WRITES = Counter(
    names.OPERATOR_OBJECT_WRITES_TOTAL.removesuffix("_total"),
    "Owned objects created or updated (drift repaired or spec changed)", ["kind", "action"])
CONFLICTS = Counter(
    names.OPERATOR_CONFLICTS_TOTAL.removesuffix("_total"), "409 conflicts retried with fresh state")


class OperatorMetrics:
    """The autoscaler's series, labelled like the engine's so alerts can join them."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        labels = ["namespace", "inferenceservice"]
        self.desired_replicas = Gauge(names.AUTOSCALER_DESIRED_REPLICAS,
                                      "Replicas the autoscaler wants", labels, registry=registry)
        self.max_replicas = Gauge(names.AUTOSCALER_MAX_REPLICAS,
                                  "spec.autoscaling.maxReplicas", labels, registry=registry)
        self.decisions = Counter(names.AUTOSCALER_DECISIONS_TOTAL, "Autoscaler decisions",
                                 labels + ["direction", "reason"], registry=registry)
        self.scrape_errors = Counter(names.METRICS_SCRAPE_ERRORS_TOTAL,
                                     "Engine pods whose metrics could not be read", labels, registry=registry)
        self.effective_max_num_seqs = Gauge(names.EFFECTIVE_MAX_NUM_SEQS,
                                            "max_num_seqs in effect on each engine pod",
                                            labels + ["pod"], registry=registry)
        self.untrusted_pods = Gauge(names.AUTOSCALER_UNTRUSTED_PODS,
                                    "Pods with the engine labels that are not the InferenceService's own (ignored)",
                                    labels, registry=registry)
        self._pods: dict[tuple[str, str], set[str]] = {}
        self._decision_labels: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def record(self, namespace: str, name: str, settings: Settings, decision: Decision,
               scrape_errors: int, seqs_by_pod: dict[str, int]) -> None:
        self.desired_replicas.labels(namespace, name).set(decision.desired_replicas)
        self.max_replicas.labels(namespace, name).set(settings.max_replicas)
        self.decisions.labels(namespace, name, decision.direction, decision.reason).inc()
        self._decision_labels.setdefault((namespace, name), set()).add((decision.direction, decision.reason))
        if scrape_errors:
            self.scrape_errors.labels(namespace, name).inc(scrape_errors)
        for pod, value in seqs_by_pod.items():
            self.effective_max_num_seqs.labels(namespace, name, pod).set(value)
        for gone in self._pods.get((namespace, name), set()) - set(seqs_by_pod):
            self.effective_max_num_seqs.remove(namespace, name, gone)
        self._pods[(namespace, name)] = set(seqs_by_pod)

    def record_untrusted(self, namespace: str, name: str, count: int) -> None:
        self.untrusted_pods.labels(namespace, name).set(count)

    def forget(self, namespace: str, name: str) -> None:
        """Every series of a deleted (or no longer autoscaled) InferenceService goes."""
        for series in (self.desired_replicas, self.max_replicas, self.scrape_errors, self.untrusted_pods):
            try:
                series.remove(namespace, name)
            except KeyError:
                pass
        for pod in self._pods.pop((namespace, name), set()):
            self.effective_max_num_seqs.remove(namespace, name, pod)
        for direction, reason in self._decision_labels.pop((namespace, name), set()):
            self.decisions.remove(namespace, name, direction, reason)
