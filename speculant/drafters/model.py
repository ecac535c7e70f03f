"""``model:PATH``: a smaller causal LM with the target's tokenizer drafts with its own KV cache.

Each pass it first feeds the tokens the target accepted since its last proposal (the whole prompt
the first time), then drafts γ tokens one at a time, each from the same processed distribution (q) the verifier will use.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..models import quantized
from ..models.backend import Backend
from ..models.loading import LoadedModel, load_model, resolve_model_path
from ..sampling import TokenHistory
from .base import DraftContext, Drafter, ListedChains, Proposal, common_prefix, left_pad, seconds_since
from .cross_tokenizer import CrossTokenizerDrafter
from .spec import Build, DrafterKind, DrafterSpec

__all__ = ["ModelDrafter", "MODEL", "check_same_tokenizer", "fit_vocab", "left_pad", "load_draft", "same_vocabulary"]


# a draft token the drafter gives less than this ends its row's draft (ModelDrafter._draft): measured on the
# Qwen2.5-Coder pair (benchmarks/results/cpu-AVX512BF16-2026-12-07-zen5-real-pair/)
MIN_CONFIDENCE = 0.3


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

    # a row stops drafting after a token the drafter gives less than this (0: always γ tokens)
    min_confidence = MIN_CONFIDENCE

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
        self.unfed = [True] * len(ctx.prompts)  # per row: its prompt is still to be fed
        # per row: where the last proposal's drafts begin in the drafter's cache, -1 where none was
        # made since the last update (a row that joined since, or a pass with γ 0)
        self.block_start = torch.full((len(ctx.prompts),), -1, dtype=torch.long, device=ctx.device)
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
        # a prompt, fed lazily: a one-off, not what a draft token costs
        self.catchup_seconds = seconds_since(t0, self.ctx.device) if any(self.unfed) else 0.0
        self.unfed = [False] * len(self.unfed)
        self.block_start = self.state.lengths()
        return self._draft(logits, gamma, lambda tok: self.state.append(tok)[:, -1])

    def _draft(self, logits: torch.Tensor, gamma: int, step) -> Proposal:
        """Up to γ tokens, each picked from the processed distribution of the logits before it (q);
        ``step`` feeds a picked token [B, 1] and returns the next logits [B, V]. A row stops drafting
        after a token the drafter gave less than ``min_confidence`` (its processed probability): its
        next drafts would seldom be accepted and each costs a drafter step and a verified row (the
        drafts are proposals only: where a row stops changes no output). ``self.fed``: the drafts fed
        back into the drafter's cache."""
        proc = self.ctx.processing
        B = logits.shape[0]
        drafts = torch.zeros(B, gamma, dtype=torch.long, device=self.ctx.device)
        lengths = torch.full((B,), gamma, dtype=torch.long, device=self.ctx.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.ctx.device)
        probs = [] if not proc.greedy else None
        self.fed = 0
        for j in range(gamma):
            logits = fit_vocab(logits, self.ctx.vocab_size)
            context = self.history.after(drafts[:, :j]) if self.history is not None else None
            tok, q = proc.pick(logits, context, self.ctx.generator, self.ctx.seeded, j)
            drafts[:, j] = tok
            if probs is not None:
                probs.append(q)
            if j == gamma - 1:
                break
            if self.min_confidence > 0:
                dist = q if q is not None else torch.softmax(proc.scores(logits, context).float(), -1)
                unsure = ~stopped & (dist.gather(1, tok[:, None])[:, 0] < self.min_confidence)
                lengths = torch.where(unsure, j + 1, lengths)
                stopped |= unsure
                if bool(stopped.all()):
                    break
            logits = step(tok[:, None])
            self.fed += 1
        if probs is not None and len(probs) < gamma:  # drafting stopped early: unused slots (past every length)
            probs += [probs[-1]] * (gamma - len(probs))
        self.fed_drafts = drafts[:, : self.fed].tolist()
        return Proposal(drafts, lengths, torch.stack(probs, 1) if probs else None)

    def update(self, new_tokens, n_accepted) -> None:
        proposed = self.block_start.tolist()
        # the drafts fed into the drafter's cache that the text kept: a row's leading new tokens (the
        # accepted drafts, unless a lookup proposed this row's instead: model:PATH+ngram)
        keep = [common_prefix(fed, new) if at >= 0 else 0 for fed, new, at in zip(self.fed_drafts, new_tokens, proposed)]
        if max(proposed, default=-1) >= 0:  # a row that made none keeps its whole cache
            ends = [at + k if at >= 0 else 1 << 40 for at, k in zip(proposed, keep)]
            self.state.rollback(torch.tensor(ends, device=self.ctx.device))
        # a row that proposed feeds what its cache lacks of its new tokens; one that did not (its
        # first token, a row that joined since, a pass with γ 0) feeds them after what it had to feed
        self.to_feed = [toks[k:] if at >= 0 else fed + list(toks)
                        for fed, toks, at, k in zip(self.to_feed, new_tokens, proposed, keep)]
        self.block_start = torch.full_like(self.block_start, -1)
        if self.history is not None:
            self.history.extend(new_tokens)

    joins = True  # every row's state is a row field: rows of another batch join between passes
    row_fields = ("state", "block_start", "to_feed", "unfed", "history", "fed_drafts")  # per-row state (PerRow)


class LookupFirstDrafter(Drafter):
    """``model:PATH+ngram``: a row whose text the prompt lookup matches strongly (the n-gram its chain
    continues is ``STRONG`` tokens long: on the bench's RAG, summaries and agentic answers the copy
    runs on) takes the lookup's chain, which costs nothing; the others the draft model's (a pass where
    every row has one skips the model). Both are functions of the accepted text: a lookup draft's q is
    one-hot, so greedy and sampled verification stay exact. Each chain is graded (0: the model's;
    1 + n: a lookup's of an n-gram) so γ auto keeps their acceptance apart."""

    STRONG = 3

    def __init__(self, model: ModelDrafter):
        from .ngram import NgramDrafter

        self.model, self.lookup = model, NgramDrafter()
        self.name = "model+ngram"

    def describe(self) -> str:
        return f"{self.model.describe()}+ngram"

    def state_bytes(self, rows: int, tokens: int) -> int:
        return self.model.state_bytes(rows, tokens)

    @property
    def catchup_seconds(self) -> float:
        return self.model.catchup_seconds if self.used_model else 0.0

    def start(self, ctx: DraftContext) -> None:
        self.ctx, self.used_model = ctx, False
        self.model.start(ctx)
        self.lookup.start(ctx)

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        looked = self.lookup.propose(gamma)
        chains, grades = looked.chains, looked.grades
        strong = [bool(c) and g >= self.STRONG for c, g in zip(chains, grades)]
        self.used_model = not all(strong)
        if not self.used_model:
            return ListedChains(chains, gamma, self.ctx.device, [1 + g for g in grades])
        prop = self.model.propose(gamma)
        if not any(strong):
            prop.grades = [0] * len(chains)
            return prop
        tokens, lengths = prop.tokens.clone(), prop.lengths.clone()
        probs = None if prop.probs is None else prop.probs.clone()
        for b, chain in enumerate(chains):
            if strong[b]:
                tokens[b, : len(chain)] = torch.tensor(chain, dtype=torch.long, device=tokens.device)
                lengths[b] = len(chain)
                if probs is not None:  # a lookup draft is certain: q one-hot
                    probs[b, : len(chain)] = 0.0
                    probs[b, torch.arange(len(chain)), tokens[b, : len(chain)]] = 1.0
        return Proposal(tokens, lengths, probs, grades=[1 + g if s else 0 for g, s in zip(grades, strong)])

    def update(self, new_tokens, n_accepted) -> None:
        self.lookup.update(new_tokens, n_accepted)
        self.model.update(new_tokens, n_accepted)

    joins = True
    row_fields = ("model", "lookup")  # per-row state (PerRow): both inner drafters' rows

    def fork(self) -> "LookupFirstDrafter":
        other = super().fork()
        other.model, other.lookup = self.model.fork(), self.lookup.fork()
        return other

    def finish(self) -> None:
        self.model.finish()
        self.lookup.finish()


def same_vocabulary(target_tok, draft_tok) -> bool:
    return len(target_tok) == len(draft_tok) and target_tok.get_vocab() == draft_tok.get_vocab()


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """A draft model must share the target's vocabulary: token ids are compared one for one."""
    if target_tok is None or draft_tok is None:  # a bare model (speculant.generate): nothing to compare
        return
    if not same_vocabulary(target_tok, draft_tok):
        raise SpeculantError(
            f"drafter '{draft_name}' has a different vocabulary ({len(draft_tok)} tokens) from the target's "
            f"({len(target_tok)} tokens): use a draft model with the target's tokenizer"
        )


def load_draft(path: str, target: LoadedModel, device=None, dtype=None) -> LoadedModel:
    """A draft model, on the target's device and in its dtype unless told otherwise (loads are memoised)."""
    return load_model(path, device=target.device if device is None else device, dtype=dtype or target.model.dtype,
                      draft=dtype == "q8")


def _make(spec: DrafterSpec, b: Build) -> Drafter:
    dtype = b.dtype
    if quantized.drafts_on_kernels(b.target.model) and resolve_model_path(spec.arg).is_file() and b.device in (None, "cpu"):
        dtype = "q8"  # a GGUF draft model beside a target on the kernels: its own blocks on the int8 kernels
    draft = load_draft(spec.arg, b.target, b.device, dtype)
    if b.target.tokenizer is not None and not same_vocabulary(b.target.tokenizer, draft.tokenizer):
        return CrossTokenizerDrafter(draft.model, draft.tokenizer, b.target.tokenizer, label=draft.name)
    return ModelDrafter(draft.model, label=draft.name)


def _vllm(spec: DrafterSpec, fixed: int | None) -> dict:
    if spec.arg.endswith(".gguf") or spec.arg == "default":
        raise SpeculantError("vLLM loads draft models from Hugging Face folders: give model:FOLDER, not a GGUF")
    return {"method": "draft_model", "model": str(Path(spec.arg).resolve()), "num_speculative_tokens": fixed or 5}


MODEL = DrafterKind(
    "model", "model:PATH (PATH: a model folder, a .gguf file, or 'default'; another tokenizer works through text)",
    _make, prefix="model:", check=lambda spec: resolve_model_path(spec.arg), vllm=_vllm)
