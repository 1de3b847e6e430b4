"""The torch attention backend of an earlier git revision, for step_overhead's and step_profile's
`--baseline-rev` (engine/attention/torch_backend.py is self-contained, so its source at that
revision runs as a module of its own)."""

from __future__ import annotations

import subprocess
import sys
import types

from bench import common


class FullAttentionOnly:
    """Mixed in before an earlier revision's backend, whose attend may take no per-layer options:
    the options the model passes are dropped while they ask for plain causal attention."""

    def attend(self, query, k_cache, v_cache, meta, scale, *options):
        for option in options:
            if getattr(option, "sliding_window", None) is not None or getattr(option, "logit_softcap", None):
                raise SystemExit(f"--baseline-rev's backend cannot run {option}: use a model with plain attention")
        return super().attend(query, k_cache, v_cache, meta, scale)


def torch_backend_class(rev: str) -> type:
    """TorchBackend as it was at rev, taking (and dropping) the model's full-attention options."""
    source = subprocess.run(["git", "show", f"{rev}:engine/attention/torch_backend.py"], check=True,
                            capture_output=True, text=True, cwd=common.REPO).stdout
    module = types.ModuleType("baseline_torch_backend")
    sys.modules[module.__name__] = module  # dataclasses resolve string annotations through sys.modules
    exec(compile(source, "baseline_torch_backend.py", "exec"), module.__dict__)  # noqa: S102
    return type("BaselineTorchBackend", (FullAttentionOnly, module.TorchBackend), {})
