"""Drafters: one file each, all behind the ``Drafter`` interface (propose / update); the kinds a
spec string names are listed in ``registry.py``."""
from __future__ import annotations

from .base import DraftContext, Drafter, Proposal
from .cascade import CascadeDrafter, split_cascade
from .cross_tokenizer import CrossTokenizerDrafter
from .layerskip import LayerSkipDrafter
from .model import ModelDrafter, check_same_tokenizer, same_vocabulary
from .ngram import NgramDrafter
from .none import NoDrafter
from .registry import (DRAFTER_HELP, HYBRID, KINDS, TRAINED_KINDS, DrafterSpec, check_spec, default_drafter,
                       load_trained, make_drafter, parse_spec, shipped_drafter, validate_drafter_spec)
from .suffix import SuffixDrafter

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
    "shipped_drafter",
    "check_same_tokenizer",
    "same_vocabulary",
    "validate_drafter_spec",
    "DRAFTER_HELP",
    "HYBRID",
    "KINDS",
    "TRAINED_KINDS",
    "DrafterSpec",
    "parse_spec",
    "check_spec",
    "load_trained",
    "split_cascade",
]
