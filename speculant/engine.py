"""The speculate -> verify -> accept loop (one screen), batched over prompts.

Per pass: the drafter proposes up to γ tokens per row; the target scores [last token + drafts]
in ONE forward pass; ``verify`` keeps the longest acceptable prefix plus one token of the
target's own; both KV caches roll back to the accepted text. Rows may accept different numbers
of tokens; finished rows (EOS, stop string, max_new_tokens) leave the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .controller import CostModel, GammaController
from .drafters.base import DraftContext, Drafter, Proposal
from .drafters.model import left_pad
from .models.backend import Backend
from .sampling import LogitsProcessing, SamplingParams, TokenHistory, token_logprobs
from .verify import greedy_verify, sample_verify


@dataclass
class Stats:
    """Counters of one request (one row of a batch)."""

    drafter: str = "none"
    gamma: int | str = 0  # or "auto"
    gamma_sum: int = 0  # draft length this row was allowed, summed over passes (for the mean γ)
    new_tokens: int = 0
    target_passes: int = 0  # including the prefill pass, which yields the first token
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """τ: tokens the target produced per forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def count_pass(self, drafted: int, accepted: int, gamma: int = 0) -> None:
        self.target_passes += 1
        self.gamma_sum += gamma
        self.drafted += drafted
        self.accepted += accepted
        for j in range(drafted):
            if j >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted

    def to_dict(self) -> dict:
        return {
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "target_forward_passes": self.target_passes,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "drafter": self.drafter,
            "gamma": self.gamma,
            "mean_gamma": round(self.gamma_sum / max(1, self.target_passes - 1), 3),
            "new_tokens": self.new_tokens,
            "draft_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
            "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "drafter_seconds": round(self.drafter_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "seconds": round(self.seconds, 4),
        }


@dataclass
class Row:
    """One request's output as it grows."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # per token, when requested
    finished: bool = False
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)


@dataclass
class Request:
    prompts: list[list[int]]
    params: SamplingParams
    max_new_tokens: int
    gamma: int | str  # "auto": chosen each pass by a GammaController
    seed: int | None = None
    stop_check: object = None  # callable(row_tokens) -> index to cut at, or None
    logprobs: int | None = None  # top-N alternatives per token (0 = the chosen token's only)
    gamma_max: int = 8  # the most "auto" may draft


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, target: torch.nn.Module, drafter: Drafter, eos_token_ids: set[int], context_length: int,
                 backend: Backend | None = None):
        self.target = target
        self.backend = backend or Backend(target)
        self.drafter = drafter
        self.eos = set(eos_token_ids)
        self.context_length = context_length
        self.device = next(target.parameters()).device
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.costs = CostModel()  # what passes cost here, learnt by gamma="auto" across requests

    def run(self, req: Request) -> Iterator[tuple[int, list[int]]]:
        """Generate; yields (row, new tokens) as tokens are accepted; returns the list of Rows."""
        dev, params = self.device, req.params
        proc = LogitsProcessing(params, self.vocab_size)
        generator = torch.Generator(device=dev)
        generator.manual_seed(req.seed if req.seed is not None else int(torch.randint(0, 2**62, (1,))))
        stats = dict(drafter=self.drafter.describe(), gamma=req.gamma)
        rows = [Row(list(p), logprobs=None if req.logprobs is None else [], stats=Stats(**stats)) for p in req.prompts]
        active = list(range(len(rows)))  # batch slot -> row index
        auto = GammaController(len(rows), req.gamma_max, costs=self.costs) if req.gamma == "auto" else None
        t0 = time.perf_counter()

        # Prefill: the target's first token comes from the prompt alone.
        longest = max(len(p) for p in req.prompts)
        gamma_max = req.gamma if isinstance(req.gamma, int) else req.gamma_max
        max_tokens = min(longest + req.max_new_tokens, self.context_length) + 2 * gamma_max + 2
        state = self.backend.new_state(len(rows), max_tokens)
        self.state, self.slots = state, active  # for inspection (tests of the rollback invariant)
        tokens, valid = left_pad(req.prompts, dev)
        history = TokenHistory(req.prompts, self.vocab_size, dev, params) if params.uses_context else None
        context = history.after(tokens[:, :0]) if history is not None else None
        logits = state.append(tokens, valid, last_only=True)[:, -1]
        dist = proc.scores(logits, context) if params.greedy else proc.probs(logits, context)
        pending = dist.argmax(-1) if params.greedy else torch.multinomial(dist, 1, generator=generator).squeeze(1)
        logprobs = _logprobs(req, dist[:, None], pending[:, None], [1] * len(rows))
        _sync(dev)
        for r in rows:
            r.stats.target_seconds += time.perf_counter() - t0
            r.stats.count_pass(0, 0)
        self.drafter.start(DraftContext(req.prompts, proc, generator, dev, self.vocab_size, max_tokens, state))
        new = [[t] for t in pending.tolist()]
        n_acc = [0] * len(rows)

        while True:
            active, keep_slots = yield from self._emit(rows, active, new, logprobs, req)
            if not active:
                break
            self.slots = active
            if len(keep_slots) < len(new):  # some rows finished: shrink the batch
                state.select(torch.tensor(keep_slots, device=dev))
                pending = pending[torch.tensor(keep_slots, device=dev)]
                for part in (history, self.drafter, auto):
                    if part is not None:
                        part.select(keep_slots)
                new = [new[i] for i in keep_slots]
                n_acc = [n_acc[i] for i in keep_slots]
            if history is not None:
                history.extend(new)
            self.drafter.update(new, n_acc)

            # γ never drafts past max_new_tokens or the context
            room = min(
                min(req.max_new_tokens - len(rows[r].tokens) for r in active),
                self.context_length - int(state.lengths().max()) - 1,
            )
            if auto is not None:
                gamma, caps = auto.choose(room - 1)
            else:
                gamma = max(0, min(req.gamma, room - 1))
                caps = [gamma] * len(active)
            td = time.perf_counter()
            prop = self.drafter.propose(gamma) if gamma > 0 else self._empty(len(active))
            prop = _cap(prop, caps)
            _sync(dev)
            tt = time.perf_counter()
            block = torch.cat([pending[:, None], prop.tokens], dim=1)
            start = state.lengths()
            logits = state.append(block)
            context = history.block(prop.tokens) if history is not None else None
            if params.greedy:
                dist = proc.scores(logits, context)
                n, pending = greedy_verify(dist.argmax(-1), prop.tokens, prop.lengths)
            else:
                dist = proc.probs(logits, context)
                n, pending = sample_verify(dist, prop.tokens, prop.lengths, prop.probs, generator)
            state.rollback(start + n + 1)
            n_acc = n.tolist()
            emitted = torch.cat([prop.tokens, pending[:, None]], 1).scatter(1, n[:, None], pending[:, None])
            logprobs = _logprobs(req, dist, emitted, [k + 1 for k in n_acc])
            _sync(dev)
            tv = time.perf_counter()
            drafts, lens, nxt = prop.tokens.tolist(), prop.lengths.tolist(), pending.tolist()
            new = [drafts[s][: n_acc[s]] + [nxt[s]] for s in range(len(active))]
            draft_cost = tt - td - (self.drafter.catchup_seconds if gamma > 0 else 0.0)
            if auto is not None:
                auto.observe(gamma, prop.tokens.shape[1] + 1, lens, n_acc, draft_cost, tv - tt)
            else:  # fixed-γ passes teach the costs too
                self.costs.observe_pass(gamma, len(active) * (prop.tokens.shape[1] + 1), draft_cost, tv - tt)
            for s, r in enumerate(active):
                st = rows[r].stats
                st.drafter_seconds += tt - td
                st.target_seconds += tv - tt
                st.count_pass(lens[s], n_acc[s], caps[s])
        self.state = None  # the cache is not kept alive between requests
        total = time.perf_counter() - t0
        for r in rows:
            r.stats.seconds = total
            r.stats.new_tokens = len(r.tokens)
        return rows

    def _empty(self, batch: int):
        z = torch.zeros(batch, 0, dtype=torch.long, device=self.device)
        return Proposal(z, torch.zeros(batch, dtype=torch.long, device=self.device))

    def _emit(self, rows: list[Row], active: list[int], new: list[list[int]], logprobs, req: Request):
        """Append each active row's new tokens, ending rows at EOS / stop / max_new_tokens."""
        still, keep_slots = [], []
        for slot, r in enumerate(active):
            row, added = rows[r], []
            for tok in new[slot]:
                added.append(tok)
                if tok in self.eos:
                    row.finish_reason = "eos"
                    break
                if len(row.tokens) + len(added) >= req.max_new_tokens:
                    row.finish_reason = "length"
                    break
                if len(row.prompt) + len(row.tokens) + len(added) >= self.context_length:
                    row.finish_reason = "context"
                    break
            if req.stop_check is not None and not row.finish_reason:
                cut = req.stop_check(row.tokens + added)
                if cut is not None:
                    added = added[: max(0, cut - len(row.tokens))]
                    row.finish_reason = "stop"
            row.tokens.extend(added)
            if logprobs is not None:
                row.logprobs.extend(logprobs[slot][: len(added)])
            if added:
                yield r, added
            if row.finish_reason:
                row.finished = True
            else:
                still.append(r)
                keep_slots.append(slot)
        return still, keep_slots


def _logprobs(req: Request, dist: torch.Tensor, tokens: torch.Tensor, count: list[int]):
    """Logprob entries of each row's first count[b] tokens, from the verify pass's processed distribution."""
    return None if req.logprobs is None else token_logprobs(dist, req.params.greedy, tokens, count, req.logprobs)


def _cap(prop: Proposal, caps: list[int]) -> Proposal:
    """Limit row b to caps[b] drafts and drop block columns no row uses (a narrower verify pass)."""
    lengths = torch.minimum(prop.lengths, torch.tensor(caps, device=prop.lengths.device))
    width = int(lengths.max()) if lengths.numel() else 0
    probs = prop.probs[:, :width] if prop.probs is not None else None
    return Proposal(prop.tokens[:, :width], lengths, probs)
