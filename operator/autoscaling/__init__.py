"""The autoscaler: metrics sources -> the pure policy -> the engine admin client and spec.replicas,
wired by the operator's timer (hook.py); what a tick did goes to the reconcile as a report."""
