"""What a drafter kind is to the registry (``registry.py``): a parsed spec string, a kind's entry,
and what a trained kind adds. Each kind declares its entry in its own file; the registry lists them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.loading import LoadedModel
from .base import Drafter


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter spec string, parsed: ``eagle:out/e+ngram`` is the kind ``hybrid`` with one part,
    the kind ``eagle`` with ``arg`` ``out/e``."""

    text: str  # as given
    kind: str  # the name of its registry entry
    arg: str | None = None  # what follows the kind's name and colon; None: the bare kind
    parts: tuple[DrafterSpec, ...] = ()  # the specs it combines (X of X+ngram; cascade's A and B)


@dataclass
class Build:
    """What building a drafter from a spec has at hand: the target, where a draft model goes, and
    ``part`` to build a part of a combined spec."""

    target: LoadedModel
    device: torch.device | str | None
    dtype: torch.dtype | str | None
    part: Callable[[DrafterSpec], Drafter]


@dataclass(frozen=True)
class TrainOption:
    """One setting that shapes or trains a trained kind: ``speculant train --NAME`` (kinds that
    declare the same name share one flag and its default) and ``settings.NAME`` in its hooks."""

    name: str  # the flag with dashes: block_size is --block-size
    default: int
    help: str  # what it is for this kind
    minimum: int = 1
    why: str = ""  # said after the minimum when a value is below it


@dataclass(frozen=True)
class TrainedKind:
    """A trained drafter kind: its folder's type, its network, how it loads as a drafter and how
    ``speculant train`` builds and trains it (its hooks, in trained/KIND.py, take the target as a
    LoadedModel and its settings: ``options``, each given or at its default)."""

    name: str  # --drafter NAME:DIR, speculant train --kind NAME
    model_type: str  # ``speculators_model_type`` in its config.json
    network: type  # the nn.Module its config builds
    load: Callable[[str, torch.nn.Module, str], Drafter]  # (folder, target module, target name) -> drafter
    # (target, verifier name, its options, tapped layers, draft vocabulary size) -> the folder's config
    training_config: Callable[..., dict]
    # (network, target, its options) -> its trainer: loss (one cached sequence), loss_batch (padded sequences), evaluate
    trainer: Callable[..., object]
    train_help: str  # what it is, for ``speculant train --kind``
    vllm: Callable[[str, dict, int | None], dict] | None  # (folder, config, fixed γ) -> vLLM's SpeculativeConfig
    # a folder's config -> the options that shape it (to train it further in batches)
    settings_of: Callable[[dict], dict]
    # (network, target, draft ids' offsets d2t or None): weights that start as the target's
    init_from_target: Callable[..., None] | None = None
    trees: bool = False  # drafts token trees (prompt lookup merges into them: X+ngram)
    taps_optional: bool = False  # its config may leave the tapped layers to the target's depth
    no_vllm: str = ""  # why vLLM cannot run a folder of it (vllm None)
    # what the kind's name alone builds (mtp: the target's own MTP layers); None: the one shipped for the target
    bare: Callable[[Build], Drafter] | None = None
    # why ``speculant train`` cannot train this kind (trained elsewhere, run here); "": it can
    train_refusal: str = ""
    draft_vocab: bool = True  # its LM head may cover a draft vocabulary (MTP's is the target's, whole)
    options: tuple[TrainOption, ...] = ()  # its own settings (--layers, --heads, ...): the CLI's flags follow


@dataclass(frozen=True)
class DrafterKind:
    """One registry entry: the spec strings a kind takes, what can be checked before any model is
    loaded, how it is built, its part of the help text and what vLLM runs for it."""

    name: str
    help: str  # its part of DRAFTER_HELP
    make: Callable[[DrafterSpec, Build], Drafter]
    exact: tuple[str, ...] = ()  # whole spec strings it takes (``ngram``, ``ngram:tree``)
    prefix: str | None = None  # or spec strings that start so (``model:``): the rest is the spec's arg
    check: Callable[[DrafterSpec], None] | None = None  # raises SpeculantError for a spec that cannot work
    trees: bool = False  # drafts token trees prompt lookup can merge into (allowed before +ngram)
    vllm: Callable[[DrafterSpec, int | None], dict] | None = None  # its vLLM SpeculativeConfig; None: it has none
    trained: TrainedKind | None = None

    def takes(self, text: str) -> bool:
        return text in self.exact or (self.prefix is not None and text.startswith(self.prefix))

    def parse(self, text: str) -> DrafterSpec:
        if text in self.exact:
            return DrafterSpec(text, self.name, text.split(":", 1)[1] if ":" in text else None)
        return DrafterSpec(text, self.name, text[len(self.prefix):])
