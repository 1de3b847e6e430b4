"""The iterserve Kubernetes operator: the InferenceService CRD and its kopf reconciliation.

Installed as iterserve.operator; never import the folder as `operator` (the standard library's name).
"""
