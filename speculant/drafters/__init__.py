"""Drafters: one file each, all behind the ``Drafter`` interface (propose / update)."""
from __future__ import annotations

from ..errors import SpeculantError
from .base import DraftContext, Drafter, Proposal
from .model import ModelDrafter
from .ngram import NgramDrafter
from .none import NoDrafter

DRAFTER_HELP = "none | ngram | model:PATH (PATH: a model folder, a .gguf file, or 'default')"


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """A draft model must share the target's vocabulary: token ids are compared one for one."""
    tv, dv = len(target_tok), len(draft_tok)
    if tv != dv or target_tok.get_vocab() != draft_tok.get_vocab():
        raise SpeculantError(
            f"drafter '{draft_name}' has a different vocabulary ({dv} tokens) from the target's ({tv} tokens): "
            "use a draft model with the target's tokenizer"
        )


def validate_drafter_spec(spec) -> None:
    """Reject a bad drafter spec before any model is loaded."""
    if isinstance(spec, Drafter):
        return
    if not isinstance(spec, str) or not spec or (spec not in ("none", "ngram") and not spec.startswith("model:")):
        raise SpeculantError(f"unknown drafter {spec!r}: use {DRAFTER_HELP}")
    if spec.startswith("model:"):
        from ..models.loading import resolve_model_path

        resolve_model_path(spec[len("model:") :] or "")


def make_drafter(spec, target, device=None, dtype=None) -> Drafter:
    """``spec`` -> a Drafter for ``target`` (a LoadedModel). ``spec`` may already be a Drafter."""
    if isinstance(spec, Drafter):
        return spec
    validate_drafter_spec(spec)
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    if spec.startswith("model:"):
        from ..models.loading import load_model

        path = spec[len("model:") :]
        draft = load_model(path, device=target.device if device is None else device, dtype=dtype or target.model.dtype)
        check_same_tokenizer(target.tokenizer, draft.tokenizer, path)
        return ModelDrafter(draft.model, label=draft.name)
    raise AssertionError(spec)  # validate_drafter_spec lets nothing else through


__all__ = [
    "DraftContext",
    "Drafter",
    "Proposal",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "make_drafter",
    "check_same_tokenizer",
    "validate_drafter_spec",
    "DRAFTER_HELP",
]
