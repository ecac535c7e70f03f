"""``speculant export --format vllm``: the ``--speculative-config`` vLLM runs for what ran here.

For serving at scale speculant hands off to vLLM: a DFlash folder from ``speculant train`` is
already in the speculators format vLLM loads, and the model-free drafters map to vLLM's own
``ngram`` and ``suffix`` methods with the matching settings. Drafters vLLM has no counterpart for
(layerskip, cascade, a drafter with another tokenizer) are refused in one line.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from .api import check_gamma
from .drafters import registry
from .errors import SpeculantError
from .models.loading import resolve_model_folder


def vllm_config(drafter: str, gamma: int | str | None = None) -> dict:
    """The vLLM ``SpeculativeConfig`` (as a dict) for a speculant drafter spec (each kind's mapping is
    in its registry entry)."""
    return registry.vllm_config(drafter, gamma if isinstance(gamma, int) else None)


def export_vllm(target: str, drafter: str, gamma=None, out: str | None = None) -> tuple[dict, str]:
    """(config, the ``vllm serve`` command line); the config is also written to ``out`` as JSON."""
    cfg = vllm_config(drafter, None if gamma is None else check_gamma(gamma))
    folder = resolve_model_folder(target)[0] if target else None
    command = f"vllm serve {shlex.quote(str(folder))} --speculative-config {shlex.quote(json.dumps(cfg))}"
    if out:
        try:
            Path(out).write_text(json.dumps(cfg, indent=2) + "\n")
        except OSError as e:
            raise SpeculantError(f"cannot write {out}: {e.strerror or e}; give --out a writable path") from None
    return cfg, command
