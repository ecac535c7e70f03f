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

from .errors import SpeculantError


def vllm_config(drafter: str, gamma: int | str | None = None) -> dict:
    """The vLLM ``SpeculativeConfig`` (as a dict) for a speculant drafter spec."""
    fixed = gamma if isinstance(gamma, int) else None
    from .drafters import HYBRID

    if drafter.endswith(HYBRID):  # vLLM runs the tree drafter alone: it has no merged prompt lookup
        drafter = drafter[: -len(HYBRID)]
    if drafter in ("ngram", "ngram:tree"):
        # ngram:tree has no vLLM twin: its chain form (the latest match) is what vLLM runs
        return {"method": "ngram", "num_speculative_tokens": fixed or 16, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    if drafter in ("suffix", "suffix:arctic"):
        from .drafters.suffix import SuffixDrafter

        d = SuffixDrafter()
        depth = 24 if drafter == "suffix:arctic" else d.max_depth
        return {"method": "suffix", "num_speculative_tokens": fixed or 32, "suffix_decoding_max_tree_depth": depth,
                "suffix_decoding_max_spec_factor": d.spec_factor, "suffix_decoding_min_token_prob": d.min_prob}
    if drafter.startswith(("medusa:", "trained:")) and _kind(drafter) == "medusa":
        raise SpeculantError("vLLM's Medusa format gives every head its own LM head and has no draft vocabulary; "
                             "speculant's medusa folders share one: export ngram, suffix, dflash:DIR or eagle:DIR instead")
    if drafter.startswith(("dflash:", "eagle:", "trained:")) or drafter in ("dflash", "eagle"):
        from .trained.format import drafter_kind, read_config, shipped_drafters

        folder = drafter.split(":", 1)[1] if ":" in drafter else None
        if folder is None:
            found = [f for f in shipped_drafters() if drafter_kind(read_config(f)) == drafter]
            if not found:
                raise SpeculantError(f"no {drafter} drafter ships with speculant: give --drafter {drafter}:DIR")
            folder = str(found[0])
        cfg = read_config(folder)
        if cfg["speculators_model_type"] == "eagle3":  # vLLM drafts a chain of N tokens with it
            return {"method": "eagle3", "model": str(Path(folder).resolve()), "num_speculative_tokens": fixed or 5}
        return {"method": cfg["speculators_model_type"], "model": str(Path(folder).resolve()),
                "num_speculative_tokens": min(fixed or cfg["block_size"] - 1, cfg["block_size"] - 1)}
    if drafter.startswith("model:"):
        path = drafter[len("model:"):]
        if path.endswith(".gguf") or path == "default":
            raise SpeculantError("vLLM loads draft models from Hugging Face folders: give model:FOLDER, not a GGUF")
        return {"method": "draft_model", "model": str(Path(path).resolve()), "num_speculative_tokens": fixed or 5}
    if drafter == "none":
        raise SpeculantError("drafter none speculates nothing: there is no speculative config to export")
    raise SpeculantError(f"drafter {drafter!r} has no vLLM counterpart: export ngram, suffix, dflash:DIR, eagle:DIR "
                         "or model:FOLDER")


def _kind(drafter: str) -> str:
    from .trained.format import read_config

    return read_config(drafter.split(":", 1)[1])["speculators_model_type"]


def export_vllm(target: str, drafter: str, gamma=None, out: str | None = None) -> tuple[dict, str]:
    """(config, the ``vllm serve`` command line); the config is also written to ``out`` as JSON."""
    from .models.loading import resolve_model_folder

    from .api import check_gamma

    cfg = vllm_config(drafter, None if gamma is None else check_gamma(gamma))
    folder = resolve_model_folder(target)[0] if target else None
    command = f"vllm serve {shlex.quote(str(folder))} --speculative-config {shlex.quote(json.dumps(cfg))}"
    if out:
        try:
            Path(out).write_text(json.dumps(cfg, indent=2) + "\n")
        except OSError as e:
            raise SpeculantError(f"cannot write {out}: {e.strerror or e}; give --out a writable path") from None
    return cfg, command
