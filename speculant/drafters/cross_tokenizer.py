"""A draft model with a *different tokenizer* than the target's, converted through text.

Each pass, per row: the accepted target tokens are decoded to text and tokenised with the
drafter's tokenizer (its KV cache keeps the longest unchanged prefix); the drafter greedily writes
a few tokens of its own; their text is re-tokenised with the target's tokenizer after a short
anchor of the accepted text, and the target tokens that follow the anchor are proposed. Where the
anchor does not re-tokenise to a prefix of anchor + draft text (a token boundary moved), the row
proposes nothing this pass. The last target token of a draft that ends inside a word is dropped.

Why this is exact, for greedy and for sampling. The proposal x is a deterministic function of the
accepted tokens (argmax decoding, fixed tokenisation), independent of the verifier's random draws,
so its q is one-hot (Proposal.probs None). The verifier accepts x with probability
min(1, p(x)/1) = p(x) and otherwise samples from norm(max(0, p - onehot(x))), which is p with x
removed, renormalised. So P(out = x) = p(x) and P(out = y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y)
for y != x: the target's distribution exactly; greedy accepts x only when it is the argmax. The
drafter's own probabilities (over another vocabulary) are never used, so nothing needs mapping.
"""
from __future__ import annotations

import torch

from ..models.backend import kv_bytes
from ..models.kv import KVState
from .base import DraftContext, Drafter, Proposal, common_prefix, left_pad


class CrossTokenizerDrafter(Drafter):
    name = "cross-tokenizer"

    def __init__(self, model: torch.nn.Module, draft_tokenizer, target_tokenizer, label: str = "model",
                 anchor: int = 8, extra: int = 2):
        self.model = model
        self.draft_tok = draft_tokenizer
        self.target_tok = target_tokenizer
        self.label = label
        self.anchor = anchor  # accepted tokens re-tokenised with the draft text, to place the boundary
        self.extra = extra  # draft tokens beyond γ: vocabularies split words differently
        self.draft_vocab = len(draft_tokenizer)
        eos = getattr(draft_tokenizer, "eos_token_id", None)
        self.draft_eos = {eos} if eos is not None else set()

    def describe(self) -> str:
        return f"model:{self.label}(via text)"

    def state_bytes(self, rows: int, tokens: int) -> int:
        return kv_bytes(self.model, rows, 2 * tokens)  # draft tokens: up to about two a target token

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.texts = [list(p) for p in ctx.prompts]  # accepted target tokens per row
        self.state = KVState(self.model, len(ctx.prompts))
        self.cached: list[list[int]] = [[] for _ in ctx.prompts]  # draft ids in the cache, per row

    def _draft_context(self) -> list[list[int]]:
        texts = self.target_tok.batch_decode(self.texts, skip_special_tokens=False)
        return [list(ids) for ids in self.draft_tok(texts, add_special_tokens=True)["input_ids"]]

    @torch.no_grad()
    def _draft(self, contexts: list[list[int]], n: int) -> torch.Tensor:
        """Greedy n draft tokens per row after ``contexts`` (the cache keeps what it already holds)."""
        dev = self.ctx.device
        keep = [min(common_prefix(c, ctx), len(ctx) - 1) for c, ctx in zip(self.cached, contexts)]
        self.state.rollback(torch.tensor(keep, device=dev))
        tokens, valid = left_pad([ctx[k:] for ctx, k in zip(contexts, keep)], dev)
        logits = self.state.append(tokens, valid, last_only=True)[:, -1]
        out = torch.zeros(len(contexts), n, dtype=torch.long, device=dev)
        for j in range(n):
            out[:, j] = logits[:, : self.draft_vocab].argmax(-1)
            if j < n - 1:
                logits = self.state.append(out[:, j : j + 1])[:, -1]
        gen = out.tolist()
        self.cached = [ctx + g[:-1] for ctx, g in zip(contexts, gen)]
        return gen

    def _to_target(self, row: int, context: list[int], gen: list[int], gamma: int) -> list[int]:
        cut = next((i for i, t in enumerate(gen) if t in self.draft_eos), len(gen))
        gen = gen[:cut]
        if not gen:
            return []
        d_tail = context[-self.anchor :]
        before = self.draft_tok.decode(d_tail, skip_special_tokens=False)
        after = self.draft_tok.decode(d_tail + gen, skip_special_tokens=False)
        if not after.startswith(before):
            return []
        draft_text = after[len(before) :]
        t_anchor = self.target_tok.decode(self.texts[row][-self.anchor :], skip_special_tokens=False)
        head = self.target_tok(t_anchor, add_special_tokens=False)["input_ids"]
        full = self.target_tok(t_anchor + draft_text, add_special_tokens=False)["input_ids"]
        if full[: len(head)] != head:
            return []  # the boundary moved: these tokens would not continue the accepted ones
        rest = list(full[len(head) :])
        bad = next((i for i, t in enumerate(rest) if t >= self.ctx.vocab_size), len(rest))
        rest = rest[:bad]  # a tokenizer may know ids past the target's LM head
        return rest[:gamma] if len(rest) > gamma else rest[:-1]

    def propose(self, gamma: int) -> Proposal:
        contexts = self._draft_context()
        gen = self._draft(contexts, gamma + self.extra)
        found = [self._to_target(r, contexts[r], gen[r], gamma) for r in range(len(contexts))]
        tokens = torch.zeros(len(found), gamma, dtype=torch.long)
        for row, cont in enumerate(found):
            if cont:
                tokens[row, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        lengths = torch.tensor([len(c) for c in found], dtype=torch.long)
        return Proposal(tokens.to(self.ctx.device), lengths.to(self.ctx.device), None)

    def update(self, new_tokens, n_accepted) -> None:
        for row, toks in enumerate(new_tokens):
            self.texts[row].extend(toks)

    joins = True
    row_fields = ("state", "texts", "cached")  # per-row state (PerRow)
