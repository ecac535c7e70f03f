"""Logits processing shared by the target (p) and every drafter (q).

Speculative sampling is exact only when p and q are the *processed* distributions, built by the
same function. Everything here is a pure tensor function of logits and the context tokens; it
never knows whether it is processing the target's or a drafter's logits.

Order follows Hugging Face ``generate``: repetition penalty, temperature, top-k, top-p, min-p.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SpeculantError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise SpeculantError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpeculantError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise SpeculantError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise SpeculantError(f"min-p must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise SpeculantError(f"repetition penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_context(self) -> bool:
        """Whether processing depends on the tokens seen so far (then drafts must be included)."""
        return self.repetition_penalty != 1.0


def block_presence(seen: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """Which tokens each position of a block has seen.

    seen: [B, V] bool, the tokens of the accepted context. block_tokens: [B, T-1], tokens fed
    after that context (draft tokens). Returns [B, T, V] where position t has also seen
    block_tokens[:, :t] -- the drafts before it, exactly as plain decoding would have.
    """
    B, V = seen.shape
    T = block_tokens.shape[1] + 1
    out = seen[:, None, :].expand(B, T, V).clone()
    if T > 1:
        hits = torch.zeros(B, T, V, dtype=torch.int32, device=seen.device)
        idx = block_tokens[:, None, :].expand(B, T, T - 1)
        # position t sees draft j when j < t
        visible = (torch.arange(T - 1, device=seen.device)[None, :] < torch.arange(T, device=seen.device)[:, None])
        hits.scatter_add_(2, idx, visible[None].expand(B, T, T - 1).to(torch.int32))
        out |= hits > 0
    return out


def apply_penalties(logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None) -> torch.Tensor:
    """Repetition penalty (Hugging Face / CTRL style): divide positive logits, multiply negative ones."""
    if params.repetition_penalty == 1.0 or presence is None:
        return logits
    penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
    return torch.where(presence, penalised, logits)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the last dimension; returns probabilities."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class LogitsProcessing:
    """One processing for p and q. ``scores`` is what greedy takes the argmax of; ``probs`` what sampling draws from."""

    def __init__(self, params: SamplingParams):
        self.params = params

    def scores(self, logits: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        return apply_penalties(logits, self.params, presence)

    def probs(self, logits: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        return warp(self.scores(logits, presence), self.params)

    def pick(self, logits: torch.Tensor, presence: torch.Tensor | None, generator: torch.Generator | None):
        """Choose one token per row from logits [B, V] (plain decoding). Returns (tokens [B], probs or None)."""
        if self.params.greedy:
            return self.scores(logits, presence).argmax(-1), None
        probs = self.probs(logits, presence)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs
