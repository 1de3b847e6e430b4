"""The autoscaler: metrics sources -> the pure policy -> the actuator, wired by the operator's timer."""
