"""Logits processing shared by the target (p) and every drafter (q).

Speculative sampling is exact only when p and q are the *processed* distributions, built by the
same function. Everything here is a pure tensor function of logits and the context tokens; it
never knows whether it is processing the target's or a drafter's logits.

Order: repetition penalty (Hugging Face / CTRL), presence and frequency penalties (OpenAI), logit
bias, user logits processors (e.g. a grammar mask), then temperature, top-k, top-p, min-p.

Everything that depends on the text so far comes in a ``Context`` built by ``TokenHistory``: for a
block of draft tokens under verification, position t sees the accepted text plus drafts[:t] --
exactly what plain decoding would have seen there -- for p and for q alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SpeculantError


LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]  # (context token ids, logits [V]) -> logits [V]


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF: over prompt + output
    presence_penalty: float = 0.0  # OpenAI: over the output only
    frequency_penalty: float = 0.0  # OpenAI: over the output only
    logit_bias: dict | None = None  # token id -> added to its logit
    logits_processors: tuple = ()  # callables (context token ids, logits [V]) -> logits [V], applied to p and q alike

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):  # a number, not "0.9"
            if not _finite_number(getattr(self, name)):
                raise SpeculantError(f"{name.replace('_', '-')} must be a number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise SpeculantError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpeculantError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise SpeculantError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise SpeculantError(f"min-p must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise SpeculantError(f"repetition penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite_number(getattr(self, name)):
                raise SpeculantError(f"{name.replace('_', ' ')} must be a finite number (0 = off), got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SpeculantError(f"logit bias must be a dict of token id -> number, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or not _finite_number(bias):
                    raise SpeculantError(f"logit bias entries must be token id (int >= 0) -> finite number, got {tok!r}: {bias!r}")
        if not isinstance(self.logits_processors, (tuple, list)) or not all(callable(f) for f in self.logits_processors):
            raise SpeculantError("logits_processors must be a list of callables (token_ids, logits) -> logits")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_output(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def uses_context(self) -> bool:
        """Whether processing depends on the tokens seen so far (then drafts must be included)."""
        return self.repetition_penalty != 1.0 or self.counts_output or bool(self.logits_processors)


def block_counts(counts: torch.Tensor, block_tokens: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
    """How often each position of a block has seen each token.

    counts: [B, V] counts in the accepted context. block_tokens: [B, T-1], tokens fed after that
    context (draft tokens). Returns [B, T, V] where position t has also seen block_tokens[:, :t]
    -- the drafts before it, exactly as plain decoding would have -- or, for a token tree, the
    drafts ``seen`` [B, T, T-1] says it has (its ancestors).
    """
    B, V = counts.shape
    T = block_tokens.shape[1] + 1
    out = counts[:, None, :].expand(B, T, V).clone()
    if T > 1:
        idx = block_tokens[:, None, :].expand(B, T, T - 1)
        if seen is None:  # a chain: position t sees draft j when j < t
            seen = (torch.arange(T - 1, device=counts.device)[None, :] < torch.arange(T, device=counts.device)[:, None])
            seen = seen[None].expand(B, T, T - 1)
        out.scatter_add_(2, idx, seen.to(out.dtype))
    return out


def block_presence(seen: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """``block_counts`` for presence only: [B, V] bool -> [B, T, V] bool."""
    return block_counts(seen.to(torch.int32), block_tokens) > 0


@dataclass
class Context:
    """What processing sees besides the logits, for each scored position (leading shape of the logits)."""

    seen: torch.Tensor | None = None  # bool [..., V]: in prompt or output (repetition penalty)
    counts: torch.Tensor | None = None  # int [..., V]: times in the output (presence / frequency)
    token_ids: list | None = None  # one full token list per position, flattened (logits processors)


class TokenHistory:
    """The text of each row so far, kept in the forms the processing needs (only those it needs)."""

    def __init__(self, prompts: list[list[int]], vocab: int, device, params: SamplingParams):
        self.vocab, self.device = vocab, device
        self.texts = [list(p) for p in prompts] if params.logits_processors else None
        self.seen = self.counts = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(len(prompts), vocab, dtype=torch.int32)
            for i, p in enumerate(prompts):
                if p:
                    self.seen[i, torch.tensor(p, dtype=torch.long)] = 1
            self.seen = self.seen.to(device)
        if params.counts_output:
            self.counts = torch.zeros(len(prompts), vocab, dtype=torch.int32, device=device)

    def extend(self, new: list[list[int]]) -> None:
        """Row b's text grew by new[b] (accepted drafts and the target's token)."""
        for row, toks in enumerate(new):
            if not toks:
                continue
            idx = torch.tensor(toks, dtype=torch.long, device=self.device)
            if self.seen is not None:
                self.seen[row, idx] = 1
            if self.counts is not None:
                self.counts[row].scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
            if self.texts is not None:
                self.texts[row].extend(toks)

    def select(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.seen = self.seen[idx] if self.seen is not None else None
        self.counts = self.counts[idx] if self.counts is not None else None
        self.texts = [self.texts[r] for r in rows] if self.texts is not None else None

    joins = True

    def join(self, other: "TokenHistory") -> None:
        """Append ``other``'s rows (histories kept in the same forms: the same processing)."""
        self.seen = torch.cat([self.seen, other.seen]) if self.seen is not None else None
        self.counts = torch.cat([self.counts, other.counts]) if self.counts is not None else None
        self.texts = self.texts + other.texts if self.texts is not None else None

    def block(self, drafts: torch.Tensor, seen: torch.Tensor | None = None) -> Context:
        """Context of each position of a verify block [B, T = G+1]: position t has seen drafts[:, :t],
        or for a token tree the drafts ``seen`` [B, T, G] marks (the node's ancestors)."""
        texts = None
        if self.texts is not None:
            d = drafts.tolist()
            T = drafts.shape[1] + 1
            if seen is None:
                texts = [text + d[b][:t] for b, text in enumerate(self.texts) for t in range(T)]
            else:
                marks = seen.tolist()
                texts = [text + [x for x, m in zip(d[b], marks[b][t]) if m]
                         for b, text in enumerate(self.texts) for t in range(T)]
        return Context(
            block_counts(self.seen, drafts, seen) > 0 if self.seen is not None else None,
            block_counts(self.counts, drafts, seen) if self.counts is not None else None,
            texts,
        )

    def after(self, drafts: torch.Tensor, lengths: torch.Tensor | None = None) -> Context:
        """Context after drafts [B, j] (the position a drafter samples draft j at); with ``lengths``,
        after row b's first lengths[b] drafts only (rows at different positions)."""
        if lengths is None:
            ones = torch.ones_like(drafts, dtype=torch.int32)
        else:
            ones = (torch.arange(drafts.shape[1], device=drafts.device)[None, :] < lengths[:, None]).to(torch.int32)
        seen = self.seen.scatter_add(1, drafts, ones) > 0 if self.seen is not None else None
        counts = self.counts.scatter_add(1, drafts, ones) if self.counts is not None else None
        texts = None
        if self.texts is not None:
            n = ones.sum(1).tolist()
            texts = [text + d[: n[b]] for b, (text, d) in enumerate(zip(self.texts, drafts.tolist()))]
        return Context(seen, counts, texts)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, ctx: Context | None) -> torch.Tensor:
    """Repetition penalty (HF / CTRL: divide positive logits, multiply negative ones, for tokens in
    prompt or output), then OpenAI's presence and frequency penalties (output tokens only):
    logit - presence * [count > 0] - frequency * count."""
    if ctx is None:
        return logits
    if params.repetition_penalty != 1.0 and ctx.seen is not None:
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(ctx.seen, penalised, logits)
    if params.counts_output and ctx.counts is not None:
        counts = ctx.counts.to(logits.dtype)
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype) - params.frequency_penalty * counts
    return logits


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

    def __init__(self, params: SamplingParams, vocab_size: int | None = None):
        self.params = params
        self._bias: torch.Tensor | None = None
        if params.logit_bias and vocab_size is not None:
            bad = [t for t in params.logit_bias if t >= vocab_size]
            if bad:
                raise SpeculantError(f"logit bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")

    def _add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.params.logit_bias:
            return logits
        if self._bias is None or self._bias.device != logits.device or self._bias.shape[0] != logits.shape[-1]:
            bias = torch.zeros(logits.shape[-1], dtype=torch.float32)
            for tok, b in self.params.logit_bias.items():
                bias[tok] = float(b)
            self._bias = bias.to(logits.device)
        return logits + self._bias.to(logits.dtype)

    def _run_processors(self, logits: torch.Tensor, ctx: Context | None) -> torch.Tensor:
        if not self.params.logits_processors:
            return logits
        if ctx is None or ctx.token_ids is None:
            raise ValueError("logits processors need the context token ids")
        flat = logits.reshape(-1, logits.shape[-1]).clone()
        for i, ids in enumerate(ctx.token_ids):
            for fn in self.params.logits_processors:
                flat[i] = fn(ids, flat[i])
        return flat.reshape(logits.shape)

    def scores(self, logits: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        logits = apply_penalties(logits, self.params, ctx)
        return self._run_processors(self._add_bias(logits), ctx)

    def probs(self, logits: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        return warp(self.scores(logits, ctx), self.params)

    def pick(self, logits: torch.Tensor, ctx: Context | None, generator: torch.Generator | None):
        """Choose one token per row from logits [B, V] (plain decoding). Returns (tokens [B], probs or None)."""
        if self.params.greedy:
            return self.scores(logits, ctx).argmax(-1), None
        probs = self.probs(logits, ctx)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


def token_logprobs(dist: torch.Tensor, greedy: bool, tokens: torch.Tensor, count: list[int], top_n: int) -> list[list[dict]]:
    """Per row, the first count[b] positions: log p(token) and the top_n alternatives under the
    processed target distribution. dist: [B, T, V] scores (greedy: log_softmax of them, i.e. the
    processed distribution at temperature 1) or probabilities (sampling). tokens: [B, T]."""
    logp = dist.float().log_softmax(-1) if greedy else dist.float().log()
    chosen = logp.gather(2, tokens[..., None]).squeeze(2).tolist()
    top_v, top_i = (logp.topk(min(top_n, logp.shape[-1]), dim=-1) if top_n > 0 else (None, None))
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out, toks = [], tokens.tolist()
    for b, n in enumerate(count):
        row = []
        for t in range(n):
            top = [] if top_v is None else [[i, v] for i, v in zip(top_i[b][t], top_v[b][t]) if v > float("-inf")]
            row.append({"token": toks[b][t], "logprob": chosen[b][t], "top": top})
        out.append(row)
    return out
