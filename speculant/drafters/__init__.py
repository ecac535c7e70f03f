"""Drafters: one file each, all behind the ``Drafter`` interface (propose / update)."""
from __future__ import annotations

from ..errors import SpeculantError
from .base import DraftContext, Drafter, Proposal
from .cascade import CascadeDrafter
from .cross_tokenizer import CrossTokenizerDrafter
from .layerskip import LayerSkipDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .suffix import SuffixDrafter

TRAINED = ("dflash:", "eagle:", "medusa:", "trained:")  # a trained drafter's folder follows the colon
SHIPPED = ("eagle", "dflash", "medusa")  # the drafter of that kind shipped inside the package for the target
DRAFTER_HELP = (
    "none | ngram | ngram:tree | suffix | suffix:arctic | eagle | dflash | medusa (the one shipped for the target) | eagle:DIR | dflash:DIR | medusa:DIR | trained:DIR | model:PATH (PATH: a model folder, a .gguf file, or 'default'; another tokenizer works "
    "through text) | layerskip[:FILE.json|:A-B:STEP] | cascade:A,B (A: ngram or model:PATH, B: model:PATH or layerskip) | "
    "X+ngram (X: a tree drafter, eagle or medusa: its tree and prompt lookup merged)"
)
HYBRID = "+ngram"


def same_vocabulary(target_tok, draft_tok) -> bool:
    return len(target_tok) == len(draft_tok) and target_tok.get_vocab() == draft_tok.get_vocab()


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """A draft model must share the target's vocabulary: token ids are compared one for one."""
    if target_tok is None or draft_tok is None:  # a bare model (speculant.generate): nothing to compare
        return
    if not same_vocabulary(target_tok, draft_tok):
        raise SpeculantError(
            f"drafter '{draft_name}' has a different vocabulary ({len(draft_tok)} tokens) from the target's "
            f"({len(target_tok)} tokens): use a draft model with the target's tokenizer"
        )


def split_cascade(spec: str) -> tuple[str, str]:
    body = spec[len("cascade:") :]
    if body.count(",") != 1:
        raise SpeculantError(f"bad cascade spec {spec!r}: use cascade:A,B (e.g. cascade:ngram,model:PATH)")
    a, b = body.split(",")
    if a != "ngram" and not a.startswith("model:"):
        raise SpeculantError(f"cascade: the first (tiny) drafter must be ngram or model:PATH, got {a!r}")
    if not b.startswith("model:") and not (b == "layerskip" or b.startswith("layerskip:")):
        raise SpeculantError(f"cascade: the middle drafter must be model:PATH or layerskip, got {b!r}")
    return a, b


def validate_drafter_spec(spec) -> None:
    """Reject a bad drafter spec before any model is loaded."""
    if isinstance(spec, Drafter):
        return
    if not isinstance(spec, str) or not spec:
        raise SpeculantError(f"unknown drafter {spec!r}: use {DRAFTER_HELP}")
    if spec.endswith(HYBRID):
        base = spec[: -len(HYBRID)]
        if base in ("none", "ngram", "ngram:tree", "suffix", "suffix:arctic", "dflash") or base.startswith(
                ("dflash:", "model:", "layerskip", "cascade:")):
            raise SpeculantError(f"{spec!r}: the drafter before +ngram must draft token trees (eagle, medusa, "
                                 "eagle:DIR, medusa:DIR)")
        validate_drafter_spec(base)
        return
    if spec in ("none", "ngram", "ngram:tree", "suffix", *SHIPPED):  # a bare kind: the one shipped for the target
        return
    if spec == "suffix:arctic":
        from .arctic_suffix import HOW_TO, available

        if not available():
            raise SpeculantError(HOW_TO)
        return
    if spec.startswith("model:"):
        from ..models.loading import resolve_model_path

        resolve_model_path(spec[len("model:") :] or "")
        return
    if spec.startswith(TRAINED):
        from ..trained.format import drafter_kind, read_config

        kind, folder = spec.split(":", 1)
        found = drafter_kind(read_config(folder))
        if kind != "trained" and found != kind:
            raise SpeculantError(f"'{folder}' holds a {found} drafter, not {kind}: "
                                 f"use --drafter {found}:{folder} or trained:{folder}")
        return
    if spec == "layerskip" or spec.startswith("layerskip:"):
        from .layerskip import validate_layerskip_spec

        validate_layerskip_spec(spec)
        return
    if spec.startswith("cascade:"):
        for part in split_cascade(spec):
            validate_drafter_spec(part)
        return
    raise SpeculantError(f"unknown drafter {spec!r}: use {DRAFTER_HELP}")


def _load_draft(path: str, target, device, dtype):
    from ..models.loading import load_model

    return load_model(path, device=target.device if device is None else device, dtype=dtype or target.model.dtype)


def load_trained(folder: str, target) -> Drafter:
    """A trained drafter folder, of the kind its config names."""
    from ..trained.format import drafter_kind, read_config

    kind = drafter_kind(read_config(folder))
    if kind == "medusa":
        from .medusa import load_medusa

        return load_medusa(folder, target.model, target.name)
    if kind == "eagle":
        from .eagle import load_eagle

        return load_eagle(folder, target.model, target.name)
    from .dflash import load_dflash

    return load_dflash(folder, target.model, target.name)


def default_drafter(target) -> str:
    """The drafter a target gets when none is named: the trained one shipped for it (it ships only
    where it measured faster than the model-free ones), a tree drafter merged with prompt lookup
    (faster still: it wins where the answer copies its context), else ngram."""
    from ..trained.format import drafter_kind, read_config, shipped_for

    folder = shipped_for(target.model)
    if folder is None:
        return "ngram"
    return f"trained:{folder}" + (HYBRID if drafter_kind(read_config(folder)) in ("eagle", "medusa") else "")


def make_drafter(spec, target, device=None, dtype=None) -> Drafter:
    """``spec`` -> a Drafter for ``target`` (a LoadedModel). ``spec`` may already be a Drafter."""
    if isinstance(spec, Drafter):
        return spec
    validate_drafter_spec(spec)
    if spec.endswith(HYBRID):
        from .hybrid import HybridDrafter

        return HybridDrafter(make_drafter(spec[: -len(HYBRID)], target, device, dtype))
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    if spec == "ngram:tree":
        return NgramDrafter(tree=True)
    if spec.startswith(TRAINED):
        return load_trained(spec.split(":", 1)[1], target)
    if spec in SHIPPED:
        from ..trained.format import shipped_for

        folder = shipped_for(target.model, spec)
        if folder is None:
            raise SpeculantError(f"no {spec} drafter ships for {target.name}: train one with `speculant train --kind "
                                 f"{spec} --target ... --out DIR` and use --drafter {spec}:DIR")
        return load_trained(str(folder), target)
    if spec == "suffix:arctic":
        from .arctic_suffix import ArcticSuffixDrafter

        return ArcticSuffixDrafter()
    if spec == "suffix":
        vocab = target.tokenizer.name_or_path if target.tokenizer is not None else target.name
        return SuffixDrafter(corpus=(vocab, len(target.tokenizer) if target.tokenizer is not None else None))
    if spec.startswith("model:"):
        path = spec[len("model:") :]
        draft = _load_draft(path, target, device, dtype)
        if target.tokenizer is not None and not same_vocabulary(target.tokenizer, draft.tokenizer):
            return CrossTokenizerDrafter(draft.model, draft.tokenizer, target.tokenizer, label=draft.name)
        return ModelDrafter(draft.model, label=draft.name)
    if spec == "layerskip" or spec.startswith("layerskip:"):
        from .layerskip import num_layers, parse_skip_spec

        skip, source = parse_skip_spec(spec, num_layers(target.model), target.name)
        return LayerSkipDrafter(target.model, skip, label=source)
    if spec.startswith("cascade:"):
        a, b = split_cascade(spec)
        if b.startswith("model:"):
            mid = _load_draft(b[len("model:") :], target, device, dtype)
            check_same_tokenizer(target.tokenizer, mid.tokenizer, b[len("model:") :])
            middle, label = mid.model, f"model:{mid.name}"
        else:
            lay = make_drafter(b, target, device, dtype)
            middle, label = lay.model, lay.describe()
        if a.startswith("model:"):
            tiny = _load_draft(a[len("model:") :], target, device, dtype)
            check_same_tokenizer(target.tokenizer, tiny.tokenizer, a[len("model:") :])
            inner = ModelDrafter(tiny.model, label=tiny.name)
        else:
            inner = NgramDrafter()
        return CascadeDrafter(inner, middle, label=label)
    raise AssertionError(spec)  # validate_drafter_spec lets nothing else through


__all__ = [
    "DraftContext",
    "Drafter",
    "Proposal",
    "CascadeDrafter",
    "CrossTokenizerDrafter",
    "LayerSkipDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "SuffixDrafter",
    "make_drafter",
    "default_drafter",
    "check_same_tokenizer",
    "same_vocabulary",
    "validate_drafter_spec",
    "DRAFTER_HELP",
]
