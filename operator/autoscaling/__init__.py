"""The autoscaler: metrics sources -> the pure policy, once per pool (the decode pool; the prefill
pool when disaggregated) -> the engine admin client and each pool's replicas field, wired by the
operator's timer (hook.py); what a tick did goes to the reconcile as a report.

settings.py (a pool: role, bounds, signal, target), readings.py (what a pod's metrics say),
policy.py (the decision), retune.py (per-pod max_num_seqs), memory.py (one per pool), loop.py
(a tick), report.py (the tick as status and Events), step_feed.py (SLO mode's step profile fitted
online on the pods' own steps)."""
