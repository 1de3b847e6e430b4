"""Attention backends: how the model reads and writes the paged KV cache (plus the small fused
ops a backend may accelerate). `torch` is the reference that runs anywhere; `triton` uses the
kernels in iterserve.engine.kernels."""

from iterserve.engine.attention.backend import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
