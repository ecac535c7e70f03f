"""``model:PATH``: a smaller causal LM with the target's tokenizer drafts with its own KV cache.

Each pass it first feeds the tokens the target accepted since its last proposal (the whole prompt
the first time), then drafts γ tokens one at a time, each from the same processed distribution (q) the verifier will use.
"""
from __future__ import annotations

import time

import torch

from ..models.backend import Backend
from ..sampling import TokenHistory
from .base import DraftContext, Drafter, Proposal, seconds_since


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
    follows_target_path = True  # Generator gives it the target's path (fast/general)

    def __init__(self, model: torch.nn.Module, label: str = "model", backend: Backend | None = None):
        self.model = model
        self.label = label
        self.backend = backend or Backend(model)

    def describe(self) -> str:
        return f"model:{self.label}"

    def state_bytes(self, rows: int, tokens: int) -> int:
        return self.backend.state_bytes(rows, tokens)

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        longest = max(len(p) for p in ctx.prompts)
        self.state = self.backend.new_state(len(ctx.prompts), ctx.max_tokens or longest + 4096)
        # lazy: the prompt is fed with the first proposal, so a request that never drafts
        # (gamma="auto" found it would not pay) never pays for the drafter's prefill
        self.to_feed: list[list[int]] = [list(p) for p in ctx.prompts]
        self.prefilled = False
        self.block_start: torch.Tensor | None = None
        self.fed_drafts: list[list[int]] = [[] for _ in ctx.prompts]
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, ctx.device, proc) if proc.uses_context else None

    def finish(self) -> None:
        if getattr(self, "state", None) is not None:
            self.backend.release(self.state)

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        tokens, valid = left_pad(self.to_feed, self.ctx.device)
        t0 = time.perf_counter()
        logits = self.state.append(tokens, valid, last_only=True)[:, -1]
        # the prompt, fed lazily: a one-off, not what a draft token costs
        self.catchup_seconds = 0.0 if self.prefilled else seconds_since(t0, self.ctx.device)
        self.prefilled = True
        self.block_start = self.state.lengths()
        self.fed = gamma - 1 if gamma > 0 else 0
        return self._draft(logits, gamma, lambda tok: self.state.append(tok)[:, -1])

    def _draft(self, logits: torch.Tensor, gamma: int, step) -> Proposal:
        """γ tokens, each picked from the processed distribution of the logits before it (q);
        ``step`` feeds a picked token [B, 1] and returns the next logits [B, V]."""
        proc = self.ctx.processing
        B = logits.shape[0]
        drafts = torch.zeros(B, gamma, dtype=torch.long, device=self.ctx.device)
        probs = [] if not proc.greedy else None
        for j in range(gamma):
            logits = fit_vocab(logits, self.ctx.vocab_size)
            context = self.history.after(drafts[:, :j]) if self.history is not None else None
            tok, q = proc.pick(logits, context, self.ctx.generator, self.ctx.seeded, j)
            drafts[:, j] = tok
            if probs is not None:
                probs.append(q)
            if j < gamma - 1:
                logits = step(tok[:, None])
        lengths = torch.full((B,), gamma, dtype=torch.long, device=self.ctx.device)
        return Proposal(drafts, lengths, torch.stack(probs, 1) if probs else None)

    def update(self, new_tokens, n_accepted) -> None:
        if self.block_start is not None:
            keep = torch.tensor([min(n, self.fed) for n in n_accepted], device=self.ctx.device)
            self.state.rollback(self.block_start + keep)
            self.to_feed = [toks[k:] for toks, k in zip(new_tokens, keep.tolist())]
        else:  # no proposal since the last update (first token, or a pass with γ = 0): the text just grew
            self.to_feed = [fed + list(t) for fed, t in zip(self.to_feed, new_tokens)]
        self.block_start = None
        if self.history is not None:
            self.history.extend(new_tokens)

    def select(self, rows) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.ctx.device)
        self.state.select(idx)
        if self.block_start is not None:
            self.block_start = self.block_start[idx]
        self.to_feed = [self.to_feed[r] for r in rows]
        if self.history is not None:
            self.history.select(rows)
