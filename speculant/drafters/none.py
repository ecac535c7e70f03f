"""``none``: proposes nothing, so the engine does plain decoding (the baseline, same code path)."""
from __future__ import annotations

import torch

from ..errors import SpeculantError
from .base import DraftContext, Drafter, Proposal
from .spec import DrafterKind


class NoDrafter(Drafter):
    name = "none"
    drafts_nothing = True  # every pass is plain: the engine runs no γ control and asks for no proposal

    def start(self, ctx: DraftContext) -> None:
        self.device = ctx.device
        self.rows = len(ctx.prompts)

    def propose(self, gamma: int) -> Proposal:
        empty = torch.zeros(self.rows, 0, dtype=torch.long, device=self.device)
        return Proposal(empty, torch.zeros(self.rows, dtype=torch.long, device=self.device))

    def update(self, new_tokens, n_accepted) -> None:
        pass

    joins = True

    def _select_more(self, rows) -> None:
        self.rows = len(rows)  # a count, not a per-row field

    def _join_more(self, other: "NoDrafter") -> None:
        self.rows += other.rows


def _vllm(spec, fixed):
    raise SpeculantError("drafter none speculates nothing: there is no speculative config to export")


NONE = DrafterKind("none", "none", lambda spec, b: NoDrafter(), exact=("none",), vllm=_vllm)
