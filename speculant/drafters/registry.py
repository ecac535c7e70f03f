"""The drafter registry: every kind of drafter in one table (``KINDS``), and the one place spec
strings (``--drafter``) are parsed, checked and built.

Each kind declares its entry in its own file (``NGRAM`` in ngram.py, ``EAGLE`` in eagle.py, ...): the
spec strings it takes, what can be checked before any model is loaded, how it is built, its part
of the help text and what vLLM runs for it; a trained kind adds its folder type, network, trainer
and loader. Adding a kind is its file and one line here. The grammar:

    none | ngram | ngram:tree | suffix | suffix:arctic      model-free
    eagle | dflash | medusa                                 the one of that kind shipped for the target
    eagle:DIR | dflash:DIR | medusa:DIR | trained:DIR       a trained folder (trained: of any kind)
    model:PATH | layerskip[:FILE.json|:A-B:STEP|:I,J]       a draft model; the target's own layers
    cascade:A,B                                             A drafts for B, B for the target
    X+ngram                                                 a tree drafter merged with prompt lookup

``parse_spec`` turns a string into a ``DrafterSpec`` (reading nothing), ``check_spec`` also checks
what can be checked before any model is loaded (folders, files, extras), ``build`` makes the drafter.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..models import quantized
from ..models.cpu_kernels import onednn_packs
from ..models.loading import LoadedModel
from ..trained.format import read_config, shipped_drafters, tapped_layers, target_differences, target_fingerprint
from .base import Drafter
from .cascade import make_cascade, split_cascade
from .dflash import DFLASH
from .dflash_family import DFLASH2, DSPARK, XPRESS
from .eagle import EAGLE
from .hybrid import HybridDrafter
from .layerskip import LAYERSKIP
from .medusa import MEDUSA
from .model import MODEL, LookupFirstDrafter, ModelDrafter
from .mtp import MTP
from .peagle import PEAGLE
from .ngram import NGRAM
from .none import NONE
from .spec import Build, DrafterKind, DrafterSpec, TrainedKind, TrainOption
from .suffix import SUFFIX

HYBRID = "+ngram"

# trained kinds: --drafter KIND:DIR or KIND alone (the one shipped for the target), speculant train --kind KIND
TRAINED_KINDS: tuple[TrainedKind, ...] = (
    EAGLE,
    DFLASH,
    MEDUSA,
    MTP,
    PEAGLE,
    DFLASH2,
    DSPARK,
    XPRESS,
)
TRAINED = {k.name: k for k in TRAINED_KINDS}
TRAINED_TYPES = {k.model_type: k for k in TRAINED_KINDS}  # by the speculators_model_type of a folder


def _train_options() -> dict[str, list[tuple[str, TrainOption]]]:
    """Every trained kind's own settings by name, each with the kinds declaring it: one
    ``speculant train`` flag a name, so kinds that share a name must share its default and minimum."""
    found: dict[str, list[tuple[str, TrainOption]]] = {}
    for kind in TRAINED_KINDS:
        for option in kind.options:
            found.setdefault(option.name, []).append((kind.name, option))
    for name, declared in found.items():
        if len({(o.default, o.minimum) for _, o in declared}) > 1:
            raise AssertionError(f"the trained kinds' option {name!r} has several defaults or minimums: {declared}")
    return found


TRAIN_OPTIONS = _train_options()


def read_trained(folder: str | Path) -> tuple[TrainedKind, dict]:
    """A trained drafter folder's kind and config, checked: a kind speculant runs, naming the target
    layers it reads, with its weights."""

    def check(cfg: dict) -> None:
        kind = cfg.get("speculators_model_type")
        if kind not in TRAINED_TYPES:
            raise SpeculantError(f"'{folder}' holds a {kind or 'non-speculators'} model; speculant runs trained "
                                 f"drafters of type {', '.join(sorted(TRAINED_TYPES))}")
        if not tapped_layers(cfg) and not TRAINED_TYPES[kind].taps_optional:  # EAGLE-3's may be the target's
            raise SpeculantError(f"{Path(folder) / 'config.json'} names no tapped target layers "
                                 "(aux_hidden_state_layer_ids)")

    cfg = read_config(folder, check)
    return TRAINED_TYPES[cfg["speculators_model_type"]], cfg


def shipped_for(target: torch.nn.Module, kind: str | None = None) -> Path | None:
    """The shipped drafter (of ``kind``, or any) trained for this very target (matched by its
    fingerprint), if any."""
    have = target_fingerprint(target)
    for folder in shipped_drafters():
        cfg = json.loads((folder / "config.json").read_text())
        want = cfg.get("speculant_target")
        if want and not target_differences(want, have) and kind in (None, TRAINED_TYPES[cfg["speculators_model_type"]].name):
            return folder
    return None


def load_trained(folder: str, target: LoadedModel) -> Drafter:
    """A trained drafter folder, of the kind its config names."""
    return read_trained(folder)[0].load(folder, target.model, target.name)


def _check_trained(spec: DrafterSpec) -> None:
    if spec.arg is None:  # the one shipped for the target: found once the target is loaded
        return
    found = read_trained(spec.arg)[0].name
    if spec.kind != "trained" and found != spec.kind:
        raise SpeculantError(f"'{spec.arg}' holds a {found} drafter, not {spec.kind}: "
                             f"use --drafter {found}:{spec.arg} or trained:{spec.arg}")


def _make_trained(spec: DrafterSpec, b: Build) -> Drafter:
    folder = spec.arg
    if folder is None and spec.kind in TRAINED and TRAINED[spec.kind].bare is not None:
        return TRAINED[spec.kind].bare(b)  # mtp: the target's own layers
    if folder is None:
        shipped = shipped_for(b.target.model, spec.kind)
        if shipped is None:
            raise SpeculantError(f"no {spec.kind} drafter ships for {b.target.name}: train one with `speculant train "
                                 f"--kind {spec.kind} --target ... --out DIR` and use --drafter {spec.kind}:DIR")
        folder = str(shipped)
    return load_trained(folder, b.target)


def _no_vllm(text: str) -> SpeculantError:
    return SpeculantError(f"drafter {text!r} has no vLLM counterpart: export ngram, suffix, dflash:DIR, eagle:DIR "
                          "or model:FOLDER")


def _vllm_trained(spec: DrafterSpec, fixed: int | None) -> dict:
    folder = spec.arg
    if folder is None and TRAINED[spec.kind].bare is not None:  # the target's own layers: no folder
        return TRAINED[spec.kind].vllm(None, {}, fixed)
    if folder is None:  # vLLM has no target to match: the first shipped folder of the kind
        if TRAINED[spec.kind].vllm is None:
            raise _no_vllm(spec.text)
        found = [f for f in shipped_drafters() if read_trained(f)[0] is TRAINED[spec.kind]]
        if not found:
            raise SpeculantError(f"no {spec.kind} drafter ships with speculant: give --drafter {spec.kind}:DIR")
        folder = str(found[0])
    kind, cfg = read_trained(folder)
    if kind.vllm is None:
        raise SpeculantError(kind.no_vllm)
    return kind.vllm(folder, cfg, fixed)


def _trained_entry(kind: TrainedKind) -> DrafterKind:
    help = f"{kind.name}[:DIR]" + (f" ({kind.name} alone: the target's own layers)" if kind.bare else "")
    return DrafterKind(kind.name, help, _make_trained, exact=(kind.name,), prefix=f"{kind.name}:",
                       check=_check_trained, trees=kind.trees, vllm=_vllm_trained, trained=kind)


_NAMES = [k.name for k in TRAINED_KINDS if k.bare is None]  # mtp alone: the target's own layers
TRAINED_FOLDER = DrafterKind(
    "trained", f"trained:DIR (a trained folder of any kind; {', '.join(_NAMES[:-1])} or {_NAMES[-1]} alone: the one "
    "shipped for the target)", _make_trained, prefix="trained:", check=_check_trained, trees=True,
    vllm=_vllm_trained)


class _Cascade(DrafterKind):
    def parse(self, text: str) -> DrafterSpec:
        a, b = split_cascade(text)
        return DrafterSpec(text, self.name, text[len(self.prefix):], (parse_spec(a), parse_spec(b)))


class _PlusNgram(DrafterKind):
    """``X+ngram``: read before the kind of X (``model:PATH+ngram`` is model:PATH, plus ngram)."""

    def takes(self, text: str) -> bool:
        return text.endswith(HYBRID)

    def parse(self, text: str) -> DrafterSpec:
        base = text[: -len(HYBRID)]
        if base.endswith(HYBRID) or not base:  # eagle+ngram+ngram: prompt lookup merged once
            raise SpeculantError(f"{shown_spec(text)}: +ngram follows one tree drafter, once (eagle+ngram, medusa+ngram)")
        kind = kind_of(base)
        if kind is not None and not kind.trees and kind.name != "model":
            raise SpeculantError(f"{text!r}: the drafter before +ngram must draft token trees (eagle, medusa, "
                                 "eagle:DIR, medusa:DIR) or be a draft model (model:PATH)")
        return DrafterSpec(text, self.name, parts=(parse_spec(base),))


CASCADE = _Cascade("cascade", "cascade:A,B (A: ngram or model:PATH, B: model:PATH or layerskip)", make_cascade,
                   prefix="cascade:")
def _make_plus_ngram(spec: DrafterSpec, b: Build) -> Drafter:
    inner = b.part(spec.parts[0])
    if spec.parts[0].kind == "model":
        if not isinstance(inner, ModelDrafter):
            raise SpeculantError(f"{spec.text!r}: model:PATH+ngram needs a draft model with the target's tokenizer")
        return LookupFirstDrafter(inner)
    return HybridDrafter(inner)


PLUS_NGRAM = _PlusNgram("hybrid", "X+ngram (X: a tree drafter, eagle or medusa: its tree and prompt lookup merged; or "
                        "model:PATH: the lookup's chain where it matches strongly, else the model's)", _make_plus_ngram,
                        trees=True)

KINDS: tuple[DrafterKind, ...] = (
    NONE,
    NGRAM,
    SUFFIX,
    *map(_trained_entry, TRAINED_KINDS),
    TRAINED_FOLDER,
    MODEL,
    LAYERSKIP,
    CASCADE,
    PLUS_NGRAM,
)
KIND = {k.name: k for k in KINDS}
DRAFTER_HELP = " | ".join(k.help for k in KINDS)


def kind_of(text: str) -> DrafterKind | None:
    """The kind a spec string names by its form alone (nothing checked); None: no kind takes it."""
    if PLUS_NGRAM.takes(text):
        return PLUS_NGRAM
    return next((k for k in KINDS if k.takes(text)), None)


MAX_SPEC_CHARS = 4096  # a drafter spec's longest form: paths included


def shown_spec(text) -> str:
    """A spec for a one-line message: a very long one by its start."""
    said = repr(text)
    return said if len(said) <= 200 else f"{said[:160]}...' ({len(text):,} characters)"


def parse_spec(text) -> DrafterSpec:
    """A drafter spec string -> its DrafterSpec (the grammar only: nothing is read)."""
    if isinstance(text, str) and len(text) > MAX_SPEC_CHARS:
        raise SpeculantError(f"drafter spec {shown_spec(text)} is longer than {MAX_SPEC_CHARS:,} characters: "
                             "give a shorter one (see --help for the kinds)")
    kind = kind_of(text) if isinstance(text, str) and text else None
    if kind is None:
        raise SpeculantError(f"unknown drafter {shown_spec(text)}: use {DRAFTER_HELP}")
    return kind.parse(text)


def check_spec(text) -> DrafterSpec:
    """Parse a spec string and check what can be checked before any model is loaded (folders,
    files, extras), its parts in order."""
    spec = parse_spec(text)
    _check(spec)
    return spec


def _check(spec: DrafterSpec) -> None:
    kind = KIND[spec.kind]
    if kind.check is not None:
        kind.check(spec)
    for part in spec.parts:
        _check(part)


def build(spec: DrafterSpec, target: LoadedModel, device=None, dtype=None) -> Drafter:
    """The drafter of a parsed (and checked) spec for ``target``; draft models go to ``device`` in
    ``dtype`` (default: the target's; beside quantized weights, bfloat16 where the CPU multiplies it
    natively: a draft network in float32 would cost more than the quantized target's own pass)."""
    if dtype is None and quantized.weights_of(target.model) and onednn_packs(torch.bfloat16):
        dtype = torch.bfloat16
    return KIND[spec.kind].make(spec, Build(target, device, dtype, lambda part: build(part, target, device, dtype)))


def validate_drafter_spec(spec) -> None:
    """Reject a bad drafter spec before any model is loaded."""
    if not isinstance(spec, Drafter):
        check_spec(spec)


def make_drafter(spec, target: LoadedModel, device=None, dtype=None) -> Drafter:
    """``spec`` -> a Drafter for ``target`` (a LoadedModel). ``spec`` may already be a Drafter."""
    if isinstance(spec, Drafter):
        return spec
    return build(check_spec(spec), target, device, dtype)


def shipped_drafter(target: LoadedModel) -> str | None:
    """The trained drafter shipped for this target as a spec, a tree drafter merged with prompt
    lookup (faster still: it wins where the answer copies its context); None where none ships."""
    folder = shipped_for(target.model)
    if folder is None:
        return None
    return f"trained:{folder}" + (HYBRID if read_trained(folder)[0].trees else "")


def default_drafter(target: LoadedModel) -> str:
    """The drafter a target gets when none is named: the trained one shipped for it (it ships only
    where it measured faster than the model-free ones), else ngram. Beside GGUF weights on the CPU
    (``dtype="q8"`` or ``"quantized"``) it is ngram too: a target pass there (~3-4 ms in q8 on a
    2-core Zen 4) is cheap beside the head's proposal (~0.5 ms in its kernel call, ~0.2 more of
    Python, and the cache it takes from the target's next pass), so at the head's τ (~1.75 at γ 2)
    ``eagle+ngram`` gains less than prompt lookup alone, its drafts graded by the n-gram they
    matched: on all 167 bench prompts 1.04-1.05× plain q8 against ngram's 1.07× side by side
    (benchmarks/results/cpu-AVX512BF16-2026-12-06-zen4-head-bits/; ngram 1.10× and no category
    below 0.99× in .../cpu-AVX512BF16-2026-12-06-zen4-fresh-machine/)."""
    shipped = shipped_drafter(target)
    if shipped is None or quantized.weights_of(target.model):
        return "ngram"
    return shipped


def vllm_config(text: str, fixed: int | None = None) -> dict:
    """vLLM's SpeculativeConfig for a spec string (``fixed``: draft tokens per pass). For X+ngram
    it is X's: vLLM has no prompt lookup merged into trees."""
    if PLUS_NGRAM.takes(text):
        text = text[: -len(HYBRID)]
    kind = kind_of(text)
    if kind is None or kind.vllm is None:
        raise _no_vllm(text)
    return kind.vllm(kind.parse(text), fixed)
