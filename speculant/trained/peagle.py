"""The P-EAGLE network (parallel EAGLE), as speculators defines it (``speculators_model_type:
"peagle"``): an EAGLE-3 head that drafts every position of a block in ONE forward.

The head is EAGLE-3's (``EagleNet``: the same layers, names and draft vocabulary). P-EAGLE adds a
learnt ``mask_hidden`` (a stand-in for the target's tapped states, [1, 1, taps x hidden], read
through the same norms and ``fc``) and a ``mask_token_id``: after the last accepted pair (the
target's states at position i, token i+1) come depth d = 1..K-1 slots holding (mask_hidden, MASK)
at position i + d, each attending to the accepted text's keys and to the slots of lower depth; the
output at depth d drafts token i+2+d. speculators trains it with COD-sampled parallel groups
(``PEagleDraftModel``); speculant runs such folders and does not train them.
"""
from __future__ import annotations

import torch
from torch import nn

from .eagle import EagleNet


class PEagleNet(EagleNet):
    """``cfg``: a speculators ``peagle`` config (EAGLE-3's, plus ``mask_token_id``)."""

    def __init__(self, cfg: dict, own_embeddings: bool = False):
        super().__init__(cfg, own_embeddings)
        if cfg.get("mask_token_id") is None:
            raise ValueError("a P-EAGLE config names its mask_token_id")
        self.mask_token_id = int(cfg["mask_token_id"])
        target_hidden = cfg.get("target_hidden_size") or cfg["transformer_layer_config"]["hidden_size"]
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, len(self.taps) * target_hidden))
        proposals = cfg.get("speculators_config", {}).get("proposal_methods") or [{}]
        self.depths = int(proposals[0].get("speculative_tokens") or 8)

    def mask_features(self) -> torch.Tensor:
        """The drafter's input state of a mask slot [H]: mask_hidden through the norms and fc, as a
        target's tapped states are."""
        return self.features(self.mask_hidden.view(len(self.taps), -1))
