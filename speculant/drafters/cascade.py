"""``cascade:A,B``: a tiny drafter A drafts for a middle model B, which drafts for the target.

Each propose(γ): B runs one speculative pass over A's γ-1 drafts (the same ``greedy_verify`` /
``sample_verify`` the engine uses), giving m accepted drafts + 1 token of B's own; B then decodes
on by itself until it holds γ tokens. Those γ tokens go to the target with q = B's processed
distribution at each of their positions. A sees only the one pass per target pass, so it is
updated with the plain Drafter protocol (its accepted count is min(target-accepted, m)).

Why the top level is still lossless. The verifier needs, for each draft position j, that the
draft x_j is distributed as q_j given x_<j (and given the verifier's own earlier accept/reject
coin flips, which are independent of the drafter given x_<j). B's inner pass is a lossless
speculative pass: the stream it emits (m drafts, then the correction or bonus token) is distributed
exactly as B's own autoregressive sampling, and continuing with B's own samples keeps it so. Hence
the first γ emitted tokens are distributed as γ autoregressive samples of B, i.e.
P(x_j | x_<j) = p_B(x_j | x_<j) -- exactly the q_j we hand over, evaluated at that position from
the same logits the token was verified or sampled with. A's hidden randomness (which drafts it
made, which were rejected) only enters through x, so it changes nothing. Greedy: every level is an
argmax, B's emitted stream is B's greedy continuation, and the target's greedy check does the rest.
"""
from __future__ import annotations

import time

import torch

from ..errors import SpeculantError
from ..models.backend import kv_bytes
from ..models.kv import KVState
from ..sampling import TokenHistory
from ..verify import greedy_verify, sample_verify
from .base import DraftContext, Drafter, Proposal, left_pad, seconds_since
from .model import ModelDrafter, check_same_tokenizer, fit_vocab, load_draft
from .ngram import NgramDrafter
from .spec import Build, DrafterSpec


class CascadeDrafter(Drafter):
    name = "cascade"

    def __init__(self, inner: Drafter, middle: torch.nn.Module, label: str = ""):
        self.inner = inner
        self.middle = middle  # any module with a HF causal-LM forward (a model, or layerskip's partial target)
        self.label = label

    def describe(self) -> str:
        return f"cascade:{self.inner.describe()},{self.label or 'model'}"

    def state_bytes(self, rows: int, tokens: int) -> int:
        return kv_bytes(self.middle, rows, tokens) + self.inner.state_bytes(rows, tokens)

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.state = KVState(self.middle, len(ctx.prompts))
        # lazy, as ModelDrafter: B reads the prompt at the first proposal, so a request that never
        # drafts never pays for B's prefill
        self.to_feed: list[list[int]] = [list(p) for p in ctx.prompts]
        self.prefilled = False
        self.block_start: torch.Tensor | None = None  # B's valid tokens per row before this pass's block
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, ctx.device, proc) if proc.uses_context else None
        self.inner.start(ctx)
        self.inner_pending = False  # whether A made a proposal this pass

    def _prefill(self) -> None:
        """First proposal: feed B all but each row's newest token, timed as a one-off catch-up."""
        self.catchup_seconds = 0.0
        if self.prefilled:
            return
        t0 = time.perf_counter()
        tokens, valid = left_pad([f[:-1] for f in self.to_feed], self.ctx.device)
        if tokens.shape[1]:
            self.state.append(tokens, valid, last_only=True)
        self.catchup_seconds = seconds_since(t0, self.ctx.device)
        self.to_feed = [f[-1:] for f in self.to_feed]
        self.prefilled = True

    def _probs_or_scores(self, logits, context):
        proc = self.ctx.processing
        return proc.scores(logits, context) if proc.greedy else proc.probs(logits, context)

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        ctx, proc = self.ctx, self.ctx.processing
        greedy = proc.greedy
        B, dev = len(self.to_feed), ctx.device
        self._prefill()
        feed, feed_valid = left_pad(self.to_feed, dev)
        self.block_start = self.state.lengths()

        # 1. A drafts γ-1 tokens; B scores [unfed accepted text + drafts] in one pass and verifies them.
        g = gamma - 1
        if g > 0:
            inner = self.inner.propose(g)
            self.catchup_seconds += self.inner.catchup_seconds
            drafts, draft_len, q_inner = inner.tokens, inner.lengths, inner.probs
            self.inner_pending = True
        else:
            drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
            draft_len, q_inner = torch.zeros(B, dtype=torch.long, device=dev), None
        block = torch.cat([feed, drafts], 1)
        valid = torch.cat([feed_valid, torch.ones_like(drafts, dtype=torch.bool)], 1)
        W = feed.shape[1]
        logits = fit_vocab(self.state.append(block, valid)[:, W - 1 :], ctx.vocab_size)
        context = self.history.block(drafts) if self.history is not None else None
        p_mid = self._probs_or_scores(logits, context)  # [B, g+1, V]
        if greedy:
            m, nxt = greedy_verify(p_mid.argmax(-1), drafts, draft_len)
        else:
            m, nxt = sample_verify(p_mid, drafts, draft_len, q_inner, ctx.generator)
        fed_counts = feed_valid.sum(1) + m  # B's cache keeps the unfed text + the accepted drafts
        self.state.rollback(self.block_start + fed_counts)
        self.inner_accepted = m.tolist()

        # 2. Per row: m drafts then B's token; q at position j is B's distribution given out[:j].
        out = torch.zeros(B, gamma, dtype=torch.long, device=dev)
        out[:, :g] = drafts
        rows = torch.arange(B, device=dev)
        out[rows, m] = nxt
        q = None
        if not greedy:
            q = torch.zeros(B, gamma, p_mid.shape[-1], dtype=p_mid.dtype, device=dev)
            q[:, : g + 1] = p_mid

        # 3. B decodes on by itself until every row holds γ tokens: row b feeds out[b, pos-1] and
        # samples position pos (rows already full run along; what they compute is discarded).
        pos = m + 1
        for _ in range(gamma - int(pos.min())):
            prev = out[rows, (pos - 1).clamp(max=gamma - 1)]
            step = fit_vocab(self.state.append(prev[:, None])[:, -1], ctx.vocab_size)
            context = self.history.after(out, pos) if self.history is not None else None
            tok, probs = proc.pick(step, context, ctx.generator)
            fill = (pos < gamma).nonzero().squeeze(1)
            out[fill, pos[fill]] = tok[fill]
            if q is not None:
                q[fill, pos[fill]] = probs[fill]
            pos = pos + 1
        self.fed_extra = gamma - 1  # B's cache holds at least out[:, :γ-1] after the unfed text
        lengths = torch.full((B,), gamma, dtype=torch.long, device=dev)
        return Proposal(out, lengths, q)

    def update(self, new_tokens, n_accepted) -> None:
        dev = self.ctx.device
        if self.block_start is not None:
            k = [min(n, self.fed_extra) for n in n_accepted]
            fed = [len(f) + kk for f, kk in zip(self.to_feed, k)]
            self.state.rollback(self.block_start + torch.tensor(fed, device=dev))
            self.to_feed = [toks[kk:] for toks, kk in zip(new_tokens, k)]
        else:  # no proposal since the last update (the prefill token, or a pass with γ = 0)
            self.to_feed = [f + list(t) for f, t in zip(self.to_feed, new_tokens)]
        if self.inner_pending:
            self.inner.update(new_tokens, [min(n, m) for n, m in zip(n_accepted, self.inner_accepted)])
        else:
            self.inner.update(new_tokens, [0] * len(new_tokens))
        self.block_start, self.inner_pending = None, False
        if self.history is not None:
            self.history.extend(new_tokens)

    def fork(self) -> "CascadeDrafter":
        twin = super().fork()
        twin.inner = self.inner.fork()  # A's state is per batch too
        return twin

    def finish(self) -> None:
        self.inner.finish()

    why_no_join = ("its middle model's lazy prefill and its inner drafter's pending pass are kept for the whole batch, "
                   "not per row")
    row_fields = ("state", "to_feed", "block_start", "history", "inner")  # per-row state (PerRow)


def split_cascade(spec: str) -> tuple[str, str]:
    """``cascade:A,B`` -> (A, B): A is ngram or model:PATH, B is model:PATH or layerskip[...]."""
    body = spec[len("cascade:") :]
    if body.count(",") != 1:
        raise SpeculantError(f"bad cascade spec {spec!r}: use cascade:A,B (e.g. cascade:ngram,model:PATH)")
    a, b = body.split(",")
    if a != "ngram" and not a.startswith("model:"):
        raise SpeculantError(f"cascade: the first (tiny) drafter must be ngram or model:PATH, got {a!r}")
    if not b.startswith("model:") and not (b == "layerskip" or b.startswith("layerskip:")):
        raise SpeculantError(f"cascade: the middle drafter must be model:PATH or layerskip, got {b!r}")
    return a, b


def make_cascade(spec: DrafterSpec, b: Build) -> CascadeDrafter:
    """The tiny drafter A and the middle model B of a parsed ``cascade:A,B`` (B: a draft model, or
    layerskip's partial target)."""
    tiny_spec, mid_spec = spec.parts
    target = b.target
    if mid_spec.kind == "model":
        mid = load_draft(mid_spec.arg, target, b.device, b.dtype)
        check_same_tokenizer(target.tokenizer, mid.tokenizer, mid_spec.arg)
        middle, label = mid.model, f"model:{mid.name}"
    else:
        lay = b.part(mid_spec)
        middle, label = lay.model, lay.describe()
    if tiny_spec.kind == "model":
        tiny = load_draft(tiny_spec.arg, target, b.device, b.dtype)
        check_same_tokenizer(target.tokenizer, tiny.tokenizer, tiny_spec.arg)
        inner = ModelDrafter(tiny.model, label=tiny.name)
    else:
        inner = NgramDrafter()
    return CascadeDrafter(inner, middle, label=label)
