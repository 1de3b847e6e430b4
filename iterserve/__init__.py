"""iterserve: a continuous-batching LLM engine (iterserve.engine) and its Kubernetes operator
(iterserve.operator)."""

__version__ = "0.1.0"
