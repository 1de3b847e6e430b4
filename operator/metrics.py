"""The operator's own Prometheus metrics about reconciling (the autoscaler's are defined by its
module; every name lives in iterserve.engine.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from iterserve.engine.metrics import (
    OPERATOR_CONFLICTS_TOTAL,
    OPERATOR_OBJECT_WRITES_TOTAL,
    OPERATOR_RECONCILE_SECONDS,
    OPERATOR_RECONCILES_TOTAL,
)

RECONCILES = Counter(
    OPERATOR_RECONCILES_TOTAL.removesuffix("_total"),
    "InferenceService reconciles by result (applied, unchanged, invalid, gone, error)", ["result"])
RECONCILE_SECONDS = Histogram(
    OPERATOR_RECONCILE_SECONDS, "Time one reconcile takes",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
OBJECT_WRITES = Counter(
    OPERATOR_OBJECT_WRITES_TOTAL.removesuffix("_total"),
    "Owned objects created or updated (drift repaired or spec changed)", ["kind", "action"])
CONFLICTS = Counter(
    OPERATOR_CONFLICTS_TOTAL.removesuffix("_total"), "409 conflicts retried with fresh state")
