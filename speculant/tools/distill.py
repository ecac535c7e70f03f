"""Self-distillation: the target answers prompts greedily through speculant's own engine, and the
features of prompt + answer (its tapped hidden states, its own next-token choices) come out of that
same pass: the engine hands the hidden states of every token it caches to a recording drafter."""
from __future__ import annotations

import torch

from ..api import drain
from ..drafters.base import Drafter, Proposal
from ..engine import Engine, Request
from ..models.backend import Backend
from ..sampling import SamplingParams
from ..trained.data import Features


class _Recorder(Drafter):
    """A drafter that drafts nothing and keeps the hidden states the engine hands over."""

    name = "recorder"

    def __init__(self, taps):
        self.hidden_layers = tuple(taps)

    def start(self, ctx):
        self.rows = [[h.to(torch.bfloat16).cpu()] for h in ctx.prompt_hidden]
        self.device, self.slots = ctx.device, list(range(len(ctx.prompts)))

    def observe_hidden(self, hidden):
        for slot, h in zip(self.slots, hidden):
            self.rows[slot].append(h.to(torch.bfloat16).cpu())

    def update(self, new_tokens, n_accepted):
        pass

    row_fields = ("slots",)  # per-row state (PerRow)

    def propose(self, gamma):
        B = len(self.slots)
        return Proposal(torch.zeros(B, 0, dtype=torch.long, device=self.device),
                        torch.zeros(B, dtype=torch.long, device=self.device))


def self_distilled_features(target, prompts: list[list[int]], taps, max_new_tokens: int) -> list[Features]:
    """The target answers each prompt greedily (one batch); features of prompt + answer."""
    recorder = _Recorder(taps)
    engine = Engine(target.model, recorder, target.eos_token_ids, target.context_length, Backend(target.model, "auto"))
    rows = drain(engine.run(Request.same(prompts, SamplingParams(), max_new_tokens, 0)))
    out = []
    for prompt, row, hs in zip(prompts, rows, recorder.rows):
        ids = list(prompt) + row.tokens
        hidden = torch.cat(hs)  # every token the target cached: all but the last one generated
        n = hidden.shape[0]
        labels = torch.tensor(ids[1 : n + 1], dtype=torch.long)  # greedy text: the target's choice is the next token
        out.append(Features(torch.tensor(ids[:n], dtype=torch.long), len(prompt), hidden, labels))
    return out
