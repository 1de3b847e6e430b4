"""End-to-end runs across engine, operator and cluster (importable as `e2e` from the repo root)."""
