"""``model:PATH``: a smaller causal LM with the target's tokenizer drafts with its own KV cache.

Each pass it first feeds the tokens the target accepted since its last proposal, then drafts γ
tokens one at a time, each from the same processed distribution (q) the verifier will use.
"""
from __future__ import annotations

import torch

from ..models.kv import KVState
from ..sampling import block_presence
from .base import DraftContext, Drafter, Proposal


def left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (tokens [B, W], valid [B, W]) right-aligned."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            tokens[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            valid[i, width - len(r) :] = True
    return tokens.to(device), valid.to(device)


def presence_of(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            seen[i, torch.tensor(r, dtype=torch.long)] = True
    return seen.to(device)


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Give drafter logits the target's width (same tokenizer, differently padded embeddings)."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: torch.nn.Module, label: str = "model"):
        self.model = model
        self.label = label

    def describe(self) -> str:
        return f"model:{self.label}"

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.state = KVState(self.model, len(ctx.prompts))
        tokens, valid = left_pad(ctx.prompts, ctx.device)
        self.state.append(tokens, valid, last_only=True)
        self.to_feed: list[list[int]] = [[] for _ in ctx.prompts]
        self.block_start: int | None = None
        self.fed_drafts: list[list[int]] = [[] for _ in ctx.prompts]
        self.seen = (
            presence_of(ctx.prompts, ctx.vocab_size, ctx.device) if ctx.processing.params.uses_context else None
        )

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        proc, params = self.ctx.processing, self.ctx.processing.params
        tokens, valid = left_pad(self.to_feed, self.ctx.device)
        logits = self.state.append(tokens, valid, last_only=True)[:, -1]
        self.block_start = self.state.length
        B = tokens.shape[0]
        drafts = torch.zeros(B, gamma, dtype=torch.long, device=self.ctx.device)
        probs = [] if not params.greedy else None
        for j in range(gamma):
            logits = fit_vocab(logits, self.ctx.vocab_size)
            presence = block_presence(self.seen, drafts[:, :j])[:, -1] if self.seen is not None else None
            tok, q = proc.pick(logits, presence, self.ctx.generator)
            drafts[:, j] = tok
            if probs is not None:
                probs.append(q)
            if j < gamma - 1:
                logits = self.state.append(tok[:, None])[:, -1]
        lengths = torch.full((B,), gamma, dtype=torch.long, device=self.ctx.device)
        self.fed = gamma - 1 if gamma > 0 else 0
        return Proposal(drafts, lengths, torch.stack(probs, 1) if probs else None)

    def update(self, new_tokens, n_accepted) -> None:
        if self.block_start is not None:
            keep = torch.tensor([min(n, self.fed) for n in n_accepted], device=self.ctx.device)
            self.state.keep(self.block_start, keep)
            self.to_feed = [toks[k:] for toks, k in zip(new_tokens, keep.tolist())]
        else:  # no proposal since the last update (the target's first token, or a pass with γ = 0)
            self.to_feed = [f + list(t) for f, t in zip(self.to_feed, new_tokens)]
        self.block_start = None
        if self.seen is not None:
            for row, toks in enumerate(new_tokens):
                if toks:
                    self.seen[row, torch.tensor(toks, device=self.ctx.device)] = True

    def select(self, rows) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.ctx.device)
        self.state.select(idx)
        self.to_feed = [self.to_feed[r] for r in rows]
        if self.seen is not None:
            self.seen = self.seen[idx]
