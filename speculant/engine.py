"""The speculate -> verify -> accept loop (one screen), batched over prompts.

Per pass: the drafter proposes up to γ tokens per row; the target scores [last token + drafts]
in ONE forward pass; ``verify`` keeps the longest acceptable prefix plus one token of the
target's own; both KV caches roll back to the accepted text. Rows may accept different numbers
of tokens; finished rows (EOS, stop string, max_new_tokens) leave the batch.
"""
from __future__ import annotations

import multiprocessing.connection
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from .controller import ChainGamma, CostModel, FixedGamma, HybridGamma, Plan, TreeGamma
from .drafters.base import DraftContext, Drafter, ListedChains, Proposal, sync
from .drafters.model import left_pad
from .errors import SpeculantError
from .models.backend import Backend
from .rows import PerRow
from .sampling import Context, LogitsProcessing, SamplingParams, SeededRows, TokenHistory, row_seed, token_logprobs
from .schema_worker import drafting
from .tree import block_layout, check_tree, depths, is_chain, path_block_index, tree_depths
from .verify import greedy_accept, greedy_verify, sample_verify, tree_greedy_verify, tree_sample_verify


class _Waiting:
    def __repr__(self) -> str:
        return "WAITING"


WAITING = _Waiting()  # what a step yields while its processing's answers have not come (Engine.step)


@dataclass
class Stats:
    """Counters of one request (one row of a batch)."""

    drafter: str = "none"
    gamma: int | str = 0  # or "auto"
    backend: dict = field(default_factory=dict)  # path, dtype, cpu_kernels (models.backend.Backend.info)
    gamma_sum: int = 0  # draft length this row was allowed, summed over passes (for the mean γ)
    new_tokens: int = 0
    target_passes: int = 0  # including the prefill pass, which yields the first token
    speculative_passes: int = 0  # passes that verified draft tokens (the others were plain decoding)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    tree_passes: int = 0  # passes that verified a token tree
    tree_nodes: int = 0  # their nodes, summed
    tree_accepted: int = 0  # their accepted depth, summed
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    first_token_seconds: float = 0.0  # until the prefill's token (time to first token)
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

    def count_pass(self, drafted: int, accepted: int, gamma: int = 0, nodes: int = 0) -> None:
        """One target pass: ``drafted`` judged positions (a tree: its depth), ``accepted`` of them,
        ``nodes`` the tree's size (0 for a chain)."""
        self.target_passes += 1
        self.speculative_passes += drafted > 0
        self.gamma_sum += gamma
        if nodes:
            self.tree_passes += 1
            self.tree_nodes += nodes
            self.tree_accepted += accepted
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
            "speculative_passes": self.speculative_passes,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "drafter": self.drafter,
            "gamma": self.gamma,
            "mean_gamma": round(self.gamma_sum / max(1, self.target_passes - 1), 3),
            "new_tokens": self.new_tokens,
            "draft_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
            "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            **({"tree_passes": self.tree_passes, "tree_nodes": self.tree_nodes,
                "mean_tree_nodes": round(self.tree_nodes / self.tree_passes, 3),
                "mean_accepted_depth": round(self.tree_accepted / self.tree_passes, 3)} if self.tree_passes else {}),
            "drafter_seconds": round(self.drafter_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "first_token_seconds": round(self.first_token_seconds, 4),
            "seconds": round(self.seconds, 4),
            **self.backend,
        }


@dataclass
class Row:
    """One request's output as it grows, and what ends it."""

    prompt: list[int]
    limit: int = 1 << 30  # max new tokens
    stop: object = None  # callable(tokens) -> index to cut at, or None
    cancelled: object = None  # callable() -> True to end the row now (finish_reason "abort")
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # per token, when requested
    finished: bool = False
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)
    t0: float = 0.0  # when its request started (perf_counter)

    def close(self) -> None:
        """The row's final stats (its time from its own start: rows join batches at other times)."""
        self.stats.seconds = time.perf_counter() - self.t0
        self.stats.new_tokens = len(self.tokens)


@dataclass
class RowRequest:
    """One prompt to continue, with its own settings (rows with other settings share a batch:
    the server's do)."""

    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    seed: int | None = None  # the row's own seed, used as given (None: unseeded; greedy rows have none)
    stop: object = None  # callable(row_tokens) -> index to cut at, or None
    logprobs: int | None = None  # top-N alternatives per token (0 = the chosen token's only)
    cancelled: object = None  # callable() -> True to end the row now (finish_reason "abort")


@dataclass
class Request:
    """One batch to generate: its rows, and what they all share (γ, and the batch's stream)."""

    rows: list[RowRequest]
    gamma: int | str  # "auto": chosen each pass by a ChainGamma or TreeGamma
    gamma_max: int | None = None  # the most "auto" may draft per pass (None: by drafter, see Engine._gamma_max)
    seed: int | None = None  # seeds the batch's stream (drafters, unseeded rows); None: a random one

    @classmethod
    def same(cls, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, gamma: int | str,
             seed: int | None = None) -> "Request":
        """Every prompt with the same settings; a seed s gives row r the seed row_seed(s, r)."""
        rows = [RowRequest(list(p), params, max_new_tokens, seeded_row(params, seed, r)) for r, p in enumerate(prompts)]
        return cls(rows, gamma, seed=seed)

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt for r in self.rows]


def drain(it: Iterator):
    """Run a generator to its end and give its return value (``run``'s: the finished rows;
    ``start_steps``': the batch)."""
    while True:
        try:
            next(it)
        except StopIteration as done:
            return done.value


def seeded_row(params: SamplingParams, seed: int | None, row: int) -> int | None:
    """Row ``row``'s seed in a request seeded with ``seed``: none for greedy rows."""
    return None if params.greedy or seed is None else row_seed(seed, row)


class Emitted(list):
    """A row's tokens from one pass; ``from_draft``: how many of the first ones were draft tokens
    the target accepted (the rest are the target's own: a correction or the bonus token)."""

    def __init__(self, tokens, from_draft: int):
        super().__init__(tokens)
        self.from_draft = from_draft


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
        self.costs = CostModel()  # what passes cost here, learnt across requests (gamma="auto" reads it)
        self.drafter_busy = False  # a batch holds self.drafter (others get forks of it)
        self._no_drafts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # _empty's, by batch size

    def run(self, req: Request) -> Iterator[tuple[int, list[int]]]:
        """Generate; yields (row, new tokens) as tokens are accepted; returns the list of Rows."""
        batch = self.start(req)
        try:
            while not batch.done:
                for item in self.step(batch):
                    if item is WAITING:
                        self.wait([batch], 0.05)
                    else:
                        yield item
        finally:  # also when the caller stops early (a closed stream): the caches and drafter go back
            rows = self.finish(batch)
        return rows

    def step(self, batch: "Batch") -> Iterator[tuple[int, list[int]]]:
        """One pass: hand out the tokens the last pass accepted (rows that end leave the batch),
        then draft, verify in ONE target pass, and account. Where the batch's processing computes
        ahead in other processes (a JSON schema's parser: ``LogitsProcessing.prefetch``), the step
        yields WAITING until their answers have come: the caller may step other batches meanwhile
        (and ``wait``), then goes on with this step."""
        b = batch
        yield from self._emit(b)
        if b.done:
            return
        self._catch_up(b)
        t0 = time.perf_counter()
        prop, plan = self._draft(b, self._room(b) - 1)
        sync(self.device)
        t1 = time.perf_counter()
        waited = yield from self._verify(b, prop)
        sync(self.device)
        self._account(b, prop, plan, t1 - t0, time.perf_counter() - t1 - waited)

    def wait(self, batches: list["Batch"], seconds: float) -> None:
        """Until an answer that one of these batches' steps waits for comes (its processors' work
        in processes of their own), or ``seconds`` pass; the GIL is released meanwhile."""
        conns = [c for b in batches for c in b.proc.connections()]
        if conns:
            multiprocessing.connection.wait(conns, seconds)

    def start(self, req: Request) -> "Batch":
        """Prefill a request's rows: the prompt through the target, whose last position is judged
        as the verify of an empty proposal (the same choice, sampling and logprobs as every pass)
        to give each row its first token. Each batch has its own KV state and drafter state
        (the engine's drafter, or a fork of it while another batch holds it), so batches may be
        stepped in any order."""
        return drain(self.start_steps(req))

    def start_steps(self, req: Request, chunk: "int | Callable[[], int]" = 0) -> Iterator[None]:
        """``start``'s work, the prompts ``chunk`` tokens at a time where that gives the very cache
        and logits of one prefill (``state.prefills_in_chunks``: q8, each row the same bits at any
        width; prompts of one length): a generator that yields after each chunk but the last and
        returns the Batch, so that other batches' passes may run between chunks (a long prompt
        holds no one). ``chunk`` may be a callable, asked before each chunk (chunks of any sizes
        give the same bits). Closed early, it gives back what it took."""
        drafter = self.drafter if not self.drafter_busy else self.drafter.fork()
        self.drafter_busy |= drafter is self.drafter  # taken now: a start between this one's chunks forks
        state = None
        try:
            most = req.gamma if isinstance(req.gamma, int) else self._gamma_max(req, drafter)
            longest = max(len(r.prompt) for r in req.rows)
            max_tokens = min(longest + max(r.max_new_tokens for r in req.rows), self.context_length) + 2 * most + 2
            state = self.backend.new_state(len(req.rows), max_tokens)
            return (yield from self._prefill(req, state, drafter, most, max_tokens, chunk))
        except BaseException:  # a failed or abandoned prefill (memory, a drafter's start) gives back what it took
            if state is not None:
                self.backend.release(state)
            self.drafter_busy &= drafter is not self.drafter
            raise

    def _prefill(self, req: Request, state, drafter: Drafter, most: int, max_tokens: int,
                 chunk: "int | Callable[[], int]" = 0) -> Iterator[None]:
        # before the clock: the backend's first info() proves its kernels' width invariance (~0.3 s
        # once a model on a CPU), no part of a request's time (speculant.load does it while loading)
        backend = self.backend.info()
        dev, n, t0 = self.device, len(req.rows), time.perf_counter()
        proc = LogitsProcessing([r.params for r in req.rows], self.vocab_size)
        generator = torch.Generator(device=dev)
        # the batch's stream (drafters, unseeded rows); seeded rows draw from streams of their own
        generator.manual_seed(row_seed(req.seed, -1) if req.seed is not None  # any int: mixed into 63 bits
                              else int(torch.randint(0, 2**62, (1,))))
        stats = dict(drafter=drafter.describe(), gamma=req.gamma, backend=backend)
        rows = [Row(list(r.prompt), r.max_new_tokens, r.stop, r.cancelled, t0=t0,
                    logprobs=None if r.logprobs is None else [], stats=Stats(**stats)) for r in req.rows]
        per_pass = drafter.block_drafts or drafter.makes_trees  # a pass's drafting cost does not grow with γ
        if drafter.drafts_nothing:  # plain decoding: γ 0, never asked to propose
            control = FixedGamma(0, self.costs, per_pass)
        elif req.gamma != "auto":
            control = FixedGamma(req.gamma, self.costs, per_pass)
        elif drafter.has_lookup:
            control = HybridGamma(n, most, costs=self.costs, per_pass=per_pass, deepens=drafter.deepens_with_budget)
        elif drafter.makes_trees:
            control = TreeGamma(n, most, costs=self.costs, per_pass=per_pass, deepens=drafter.deepens_with_budget)
        else:  # drafts that cost nothing are seen before each row's γ is chosen
            control = ChainGamma(n, most, costs=self.costs, per_pass=per_pass, sees_drafts=drafter.free_drafts)
        tokens, valid = left_pad(req.prompts, dev)
        history = TokenHistory(req.prompts, self.vocab_size, dev, proc) if proc.uses_context else None
        taps = tuple(drafter.hidden_layers)
        b = Batch(rows=rows, slots=[Slot(i, r.logprobs) for i, r in enumerate(req.rows)], gamma=req.gamma,
                  gamma_max=req.gamma_max, proc=proc, generator=generator, state=state, drafter=drafter,
                  history=history, seeded=SeededRows([r.seed for r in req.rows], dev), control=control, taps=taps)
        w, size = tokens.shape[1], chunk() if callable(chunk) else chunk
        if size and w > size and not taps and bool(valid.all()) and getattr(state, "prefills_in_chunks", bool)():
            at = 0
            while w - at > size:  # every chunk but the last: its logits are not needed
                state.append(tokens[:, at : at + size], None, last_only=True)
                at += size
                yield
                size = max(1, chunk() if callable(chunk) else chunk)
            tokens, valid = tokens[:, at:], valid[:, at:]
        out = state.append(tokens, valid, last_only=True, taps=taps)
        logits, hidden = out if taps else (out, None)
        empty = self._empty(n)
        nxt, n_acc, logp = self._decide(b, logits[:, -1:], empty, history.block(empty.tokens) if history else None)
        prompt_hidden = [hidden[b_, valid[b_]] for b_ in range(n)] if taps else None
        # hidden states of the tokens the last pass cached: none yet (the prompt's go to the drafter's start)
        self._hand_over(b, nxt, [[t] for t in nxt.tolist()], logp, [h[:0] for h in prompt_hidden] if taps else None)
        sync(dev)
        for r in rows:
            r.stats.target_seconds = r.stats.first_token_seconds = time.perf_counter() - t0
            r.stats.count_pass(0, 0)
        drafter.start(DraftContext(req.prompts, proc, generator, dev, self.vocab_size, max_tokens, state,
                                   prompt_hidden, b.seeded))
        return b

    def join(self, batch: "Batch", other: "Batch") -> None:
        """Rows of ``other`` join ``batch`` before its next pass (see Batch.can_join)."""
        if not batch.can_join(other):
            raise SpeculantError("these batches cannot join: their γ settings, drafters or the forms of text their "
                                 "processing reads (penalties, logits processors) differ")
        if other.drafter is self.drafter:
            self.drafter_busy = False
        batch.join(other)

    def finish(self, batch: "Batch") -> list[Row]:
        """The batch's rows with their final stats; its caches and drafter go back."""
        self.backend.release(batch.state)
        batch.drafter.finish()
        if batch.drafter is self.drafter:
            self.drafter_busy = False
        for r in batch.rows:
            if not r.finished:  # the caller stopped early
                r.close()
        return batch.rows

    @property
    def most_auto_drafts(self) -> int:
        """The most draft tokens (or tree nodes) a pass of gamma="auto" proposes with this drafter."""
        return self._gamma_max(None, self.drafter)

    def _gamma_max(self, req: Request | None, drafter: Drafter) -> int:
        """The most ``auto`` drafts per pass: 8 tokens for drafters that pay per draft token (models);
        model-free ones (ngram, suffix) cost nothing more for longer drafts, so 16 tokens, or tree
        nodes (48 on a GPU, where a pass verifies dozens of tokens at the price of one). On a CPU
        both get 15: with the pass's first token a 16-token block, as a 17th token costs ~12% more
        there (one more 16-row tile, measured with AMX) for a draft that rarely adds much."""
        longest = 15 if self.device.type == "cpu" else 16  # model-free drafts, and trees but on CUDA
        if req is not None and req.gamma_max is not None:
            most = req.gamma_max
        elif drafter.makes_trees:
            most = 48 if self.device.type == "cuda" else longest
        else:
            most = longest if drafter.free_drafts else 8
        return min(most, drafter.max_gamma or most)

    # ---- a pass's steps, in order ----
    def _emit(self, b: "Batch"):
        """Append each row's new tokens, ending rows at EOS / stop / max_new_tokens / context /
        cancel; the rows that end leave the batch."""
        keep = []
        for i, slot in enumerate(b.slots):
            row = b.rows[slot.row]
            added = self._take(row, slot.new)
            row.tokens.extend(added)
            if slot.logprobs is not None and row.logprobs is not None:
                row.logprobs.extend(slot.logprobs[: len(added)])
            if added:  # the first ``accepted`` of a pass's tokens were drafts; the last is the target's own
                yield slot.row, Emitted(added, min(len(added), slot.accepted))
            if row.finish_reason:
                row.finished = True
                row.close()
            else:
                keep.append(i)
        if not keep:
            b.done, b.slots = True, []
        elif len(keep) < len(b.slots):
            b.select(keep)

    def _take(self, row: Row, new: list[int]) -> list[int]:
        """What of ``new`` the row keeps; sets its finish_reason where it ends."""
        if row.cancelled is not None and row.cancelled():
            row.finish_reason = "abort"
            return []
        added = []
        for tok in new:
            added.append(tok)
            if tok in self.eos:
                row.finish_reason = "eos"
            elif len(row.tokens) + len(added) >= row.limit:
                row.finish_reason = "length"
            elif len(row.prompt) + len(row.tokens) + len(added) >= self.context_length:
                row.finish_reason = "context"
            if row.finish_reason:
                break
        if row.stop is not None and not row.finish_reason:
            cut = row.stop(row.tokens + added)
            if cut is not None:
                row.finish_reason = "stop"
                return added[: max(0, cut - len(row.tokens))]
        return added

    def _catch_up(self, b: "Batch") -> None:
        """The drafter (and the penalties' counts) learn what the last pass accepted."""
        new = [s.new for s in b.slots]
        if b.history is not None:
            b.history.extend(new)
        if b.taps:
            b.drafter.observe_hidden([s.fed for s in b.slots])
        b.drafter.update(new, [s.accepted for s in b.slots])

    def _room(self, b: "Batch") -> int:
        """Tokens the rows may still grow by this pass: drafts never run past max_new_tokens or the context."""
        return min(min(b.rows[r].limit - len(b.rows[r].tokens) for r in b.active),
                   self.context_length - int(b.state.lengths().max()) - 1)

    def _draft(self, b: "Batch", room: int) -> tuple[Proposal, Plan]:
        """Propose within ``room`` draft tokens: the γ control asks the drafter for a budget (a
        chain's γ, or a tree's whole budget) and caps each row (its γ, or the tree nodes worth
        verifying). Returns the capped proposal and the control's plan."""
        batch = len(b.slots)

        def propose(budget: int, lookup: bool = False) -> Proposal:
            if budget <= 0:
                prop = self._empty(batch)
            else:
                prop = b.drafter.propose_lookup(budget) if lookup else b.drafter.propose(budget)
            check_proposal(prop, batch, budget, self.vocab_size, self.device)
            return prop

        with drafting():  # a processor that computes ahead leaves q unprocessed where it has no answer yet
            plan = b.control.plan(room, propose)
        return _cap(plan.prop, plan.caps, lambda width: b.state.block_width(width, room), lambda: self._empty(batch)), plan

    def _verify(self, b: "Batch", prop: Proposal) -> Iterator[object]:
        """Score [pending token + drafts] in ONE target pass, accept, and keep exactly the accepted
        text in the cache; the accepted tokens wait in the slots for the next pass's ``_emit``.
        Yields WAITING while the processing's answers have not come; returns the seconds waited."""
        plain = prop.tokens.shape[1] == 0  # a pass that verifies nothing: its one token, no rollback
        block = b.pending[:, None] if plain else torch.cat([b.pending[:, None], prop.tokens], dim=1)
        start = None if plain else b.state.lengths()
        tree = None
        if prop.parents is not None and b.proc.greedy and is_chain(prop.parents, prop.lengths):
            # a tree that is one chain in every row (an EAGLE head's γ 1, say) verified as the chain:
            # the same logits (the cache sees the same keys) and, greedy, the same choice (the
            # tree's walk follows its only child), without the tree's layout and path bookkeeping
            prop = replace(prop, parents=None)
        elif prop.parents is not None:
            tree = block_layout(prop.parents)
        seen = None if tree is None else tree[1][:, :, 1:]
        context = b.history.block(prop.tokens, seen) if b.history is not None else None
        ahead = b.proc.computes_ahead and not b.proc.prefetch(context)  # asked now: answered during the pass
        out = b.state.append(block, tree=tree, taps=b.taps)
        logits, hidden = out if b.taps else (out, None)
        t0 = time.perf_counter()
        while ahead and not b.proc.prefetch(context):
            yield WAITING
        waited = time.perf_counter() - t0
        nxt, n, logp = self._decide(b, logits, prop, context)
        accepted = n.tolist()
        if tree is None:
            if not plain:
                b.state.rollback(start + n + 1)
            steps = None  # a chain: each emitted token was scored at its own block position
            drafts = prop.tokens.tolist()
        else:
            b.state.keep_path(start, b.path, n)
            steps = path_block_index(b.path, n)  # root + accepted nodes: where each emitted token was scored
            drafts = [[row[s] for s in at[1:]] for row, at in zip(block.tolist(), steps.tolist())]
            if logp is not None:
                logp = logp.gather(1, steps[..., None].expand(-1, -1, logp.shape[-1]))
        # each row's accepted drafts and the target's own token, as lists (tensor ops run cold after a pass)
        emitted = [row[:k] + [t] for row, k, t in zip(drafts, accepted, nxt.tolist())]
        fed = None
        if b.taps:  # the hidden states of the root and the accepted drafts, as cached
            fed = [hidden[i, : k + 1] if steps is None else hidden[i, steps[i, : k + 1]]
                   for i, k in enumerate(accepted)]
        self._hand_over(b, nxt, emitted, logp, fed)
        return waited

    def _decide(self, b: "Batch", logits: torch.Tensor, prop: Proposal, context: Context | None):
        """Each row's accepted drafts and next token from the target's logits over a block, each
        position processed in its ``context`` (position t has seen the first t drafts, or a tree's
        node its ancestors): (next token [B], accepted n [B], what logprobs report [B, T, V] or
        None); a tree's accepted path goes to ``b.path``."""
        scores = b.proc.scores(logits, context)
        probs = None if b.proc.greedy else b.proc.warp(scores)  # a greedy row among sampled ones: one-hot
        n, nxt, b.path = _accept(scores, probs, prop, b.proc, b.generator, b.seeded)
        wants = any(s.top_n is not None for s in b.slots)
        return nxt, n, b.proc.logprob_source(scores, probs) if wants else None

    def _hand_over(self, b: "Batch", nxt, emitted: list[list[int]], logp, fed) -> None:
        """The pass's result into the slots: row i's emitted tokens (its accepted drafts and the
        target's own), their logprobs, and the hidden states now cached."""
        counts = [len(tokens) for tokens in emitted]
        b.pending = nxt
        b.seeded.advance(counts)
        entries = None
        if logp is not None:  # the tokens as a block [B, most + 1] (padded past each row's count)
            width = max(counts)
            block = torch.tensor([e + e[-1:] * (width - len(e)) for e in emitted], dtype=torch.long, device=nxt.device)
            entries = token_logprobs(logp, block, counts, [s.top_n for s in b.slots])
        for i, (slot, tokens) in enumerate(zip(b.slots, emitted)):
            slot.new, slot.accepted = tokens, counts[i] - 1
            slot.logprobs = entries[i] if entries is not None else None
            slot.fed = fed[i] if fed is not None else None

    def _account(self, b: "Batch", prop: Proposal, plan: Plan, draft_seconds: float,
                 verify_seconds: float) -> None:
        """Per-row counters, and what the pass teaches the γ control (acceptance, costs)."""
        accepted = [s.accepted for s in b.slots]
        caps = plan.caps
        drafted = max(caps, default=0) > 0
        draft_cost = draft_seconds - (b.drafter.catchup_seconds if drafted else 0.0)
        b.control.learn(prop, plan, accepted, draft_cost, verify_seconds)
        lens = prop.row_lengths()
        # judged positions per row: a chain's length, a tree's depth
        depth = lens if prop.parents is None else tree_depths(prop.parents.tolist(), lens)
        for i, slot in enumerate(b.slots):
            st = b.rows[slot.row].stats
            st.drafter_seconds += draft_seconds
            st.target_seconds += verify_seconds
            st.count_pass(depth[i], accepted[i], caps[i], nodes=lens[i] if prop.parents is not None else 0)

    def _empty(self, batch: int):
        """A proposal of nothing (a plain pass's), its tensors made once per batch size: no part of
        a pass writes into a proposal's tensors."""
        tensors = self._no_drafts.get(batch)
        if tensors is None:
            tensors = self._no_drafts[batch] = (torch.zeros(batch, 0, dtype=torch.long, device=self.device),
                                                torch.zeros(batch, dtype=torch.long, device=self.device))
        return Proposal(*tensors)


def _accept(scores: torch.Tensor, probs: torch.Tensor | None, prop: Proposal, proc: LogitsProcessing, generator,
            seeded: SeededRows):
    """Which drafts each row keeps and its next token: (n [B], next [B], tree path [B, N] or None).
    Greedy rows follow the argmax and seeded rows their race's winners (greedy-style checks); the
    other rows rejection-sample against the drafter's q (probs: None when every row is greedy)."""
    tree = prop.parents is not None
    if probs is None:  # every row greedy
        return greedy_accept(scores, prop.tokens, prop.parents, prop.lengths)
    chosen_rows = seeded.mask | proc.greedy_rows(probs.device)
    chosen = None
    if bool(chosen_rows.any()):
        # block position 0 chooses the row's next token, a draft at depth d the one d after it
        B, T = probs.shape[:2]
        offsets = (torch.cat([torch.zeros_like(prop.parents[:, :1]), depths(prop.parents)], 1) if tree
                   else torch.arange(T, device=probs.device)[None].expand(B, T))
        choice = seeded.choose(probs, offsets)  # unseeded rows: the argmax (a greedy row's one-hot)
        chosen = (tree_greedy_verify(choice, prop.tokens, prop.parents, prop.lengths) if tree
                  else (*greedy_verify(choice, prop.tokens, prop.lengths), None))
        if bool(chosen_rows.all()):
            return chosen
    sampled = (tree_sample_verify(probs, prop.tokens, prop.parents, prop.lengths, prop.probs, generator) if tree
               else (*sample_verify(probs, prop.tokens, prop.lengths, prop.probs, generator), None))
    if chosen is None:
        return sampled
    return tuple(None if a is None else torch.where(chosen_rows.view(-1, *[1] * (a.dim() - 1)), a, b)
                 for a, b in zip(chosen, sampled))


@dataclass
class Slot:
    """A running row's place in its batch, and what its last pass produced, not yet handed out."""

    row: int  # index into Batch.rows
    top_n: int | None  # the logprobs alternatives its row asked for (None: no logprobs)
    new: list[int] = field(default_factory=list)  # the tokens the last pass accepted
    accepted: int = 0  # how many of them were draft tokens
    logprobs: list | None = None  # their logprobs entries
    fed: torch.Tensor | None = None  # hidden states of the tokens the last pass cached (trained drafters)


@dataclass
class Batch(PerRow):
    """Rows generating together: one KV state, one drafter state, one γ control. The one owner of
    the running rows: every part that keeps per-row data is one of its ``row_fields`` (and declares
    its own: speculant/rows.py), so rows leave as they finish (``select``) and the rows of another
    batch with the same γ setting join it between passes (``join``) here, in one place; a server
    decodes requests that arrive at different times as one batch. ``slots``: the running rows, in
    the order of the state's rows."""

    rows: list[Row]
    slots: list[Slot]
    gamma: int | str  # the γ setting and its bound: what every row shares (Request)
    gamma_max: int | None
    proc: LogitsProcessing
    generator: torch.Generator
    state: object
    drafter: Drafter
    history: TokenHistory | None
    seeded: SeededRows  # which rows are seeded, and where each stands
    control: FixedGamma | ChainGamma | TreeGamma | HybridGamma
    taps: tuple
    pending: torch.Tensor | None = None  # [B] each row's next token, not yet in the target's cache
    path: torch.Tensor | None = None  # a tree pass's accepted path
    done: bool = False

    # what follows the running rows, each part with its own per-row fields (PerRow)
    row_fields = ("state", "pending", "proc", "history", "seeded", "drafter", "control", "slots")

    @property
    def active(self) -> list[int]:
        """The running rows (indices into ``rows``), in slot order."""
        return [s.row for s in self.slots]

    def parts(self) -> list[PerRow]:
        """The batch's components with per-row data of their own."""
        return [part for part in (getattr(self, k) for k in self.row_fields) if isinstance(part, PerRow)]

    @property
    def accepts_rows(self) -> bool:
        """Rows of another batch may join: its parts know how to join. (A seeded row's text does not
        depend on what else runs: see SeededRows.)"""
        return not self.done and all(part.joins for part in self.parts())

    def can_join(self, other: "Batch") -> bool:
        """Whether ``other``'s rows may join this batch: both accept rows, the same γ setting, the
        same parts, and processing that reads the text in the same forms (sampling settings
        themselves are per row)."""
        same = (self.gamma == other.gamma and self.gamma_max == other.gamma_max
                and self.proc.forms == other.proc.forms)
        kinds = [type(getattr(self, k)) is type(getattr(other, k)) for k in self.row_fields]
        return same and self.accepts_rows and other.accepts_rows and all(kinds)

    def join(self, other: "Batch") -> None:
        """Take ``other``'s rows (a batch just started, or stepped apart) into this one."""
        other.slots = [replace(s, row=s.row + len(self.rows)) for s in other.slots]
        self.rows += other.rows
        super().join(other)  # every part's rows, in one place
        other.done, other.rows, other.slots = True, [], []


def _cap(prop: Proposal, caps: list[int], block_width=None, nothing=None) -> Proposal:
    """Limit row b to caps[b] drafts (a tree: its first caps[b] nodes, themselves a tree) and drop
    block columns no row uses (a narrower verify pass), or keep ``block_width(used)`` columns: past
    every row's length they are verified and ignored, like a batch's shorter rows. ``nothing()``: a
    proposal of no drafts for these rows (tensors made once), for a pass that verifies none."""
    if prop.columns() == 0 and (block_width is None or block_width(0) == 0):
        return Proposal(prop.tokens, prop.lengths, grades=prop.grades)  # nothing proposed: a plain pass
    proposed = prop.row_lengths()
    kept = [min(n, c) for n, c in zip(proposed, caps)]
    width = max(kept, default=0)
    if block_width is not None:
        width = block_width(width)
    if kept == proposed and width == prop.columns():
        return prop  # every draft verified as proposed (a small op each saved: they run cold after a pass)
    if not width and prop.parents is None:  # nothing verified: a plain pass (a lookup's weak draft, say)
        empty = nothing() if nothing is not None else Proposal(prop.tokens[:, :0], prop.lengths.new_zeros(len(kept)))
        empty.grades = prop.grades
        return empty
    lengths = torch.tensor(kept, device=prop.lengths.device, dtype=prop.lengths.dtype)

    def fit(t, fill=0):
        if t is None or not width:
            return None  # no nodes left: no tree either
        if t.shape[1] >= width:
            return t[:, :width]
        return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)], 1)

    tokens = fit(prop.tokens) if width else prop.tokens[:, :0]
    return Proposal(tokens, lengths, fit(prop.probs), fit(prop.parents, -1), fit(prop.scores), prop.grades)


def check_proposal(prop: Proposal, batch: int, gamma: int, vocab: int, device: torch.device) -> None:
    """A drafter's proposal, checked at the engine's boundary: one line naming what is wrong. Chains
    held as lists (``ListedChains``) are checked as lists, and on a CPU the ids from a list: after a
    pass has streamed the weights every small op runs cold."""
    listed = isinstance(prop, ListedChains)
    t = None if listed else prop.tokens
    shape = (len(prop.chains), prop.width) if listed else tuple(getattr(t, "shape", ()))
    if (not listed and not isinstance(t, torch.Tensor)) or len(shape) != 2 or shape[0] != batch or shape[1] > max(gamma, 0):
        raise SpeculantError(f"drafter returned draft tokens of shape {shape}; expected "
                             f"[{batch}, <= {gamma}] (rows, draft tokens): fix the drafter's propose()")
    where = torch.device(prop.device) if listed else t.device
    if where != device or (not listed and prop.lengths.device != device):
        raise SpeculantError(f"drafter returned tensors on {where}, but the target runs on {device}")
    lengths = prop.row_lengths() if listed or tuple(prop.lengths.shape) == (batch,) else None
    if lengths is None or len(lengths) != batch or not all(0 <= n <= shape[1] for n in lengths):
        raise SpeculantError(f"drafter returned lengths {prop.lengths.tolist()}: each must be within 0..{shape[1]}")
    if listed or where.type == "cpu":
        ids = [i for row in (prop.chains if listed else t.tolist()) for i in row]
        extremes = (min(ids), max(ids)) if ids else ()
    else:
        extremes = torch.aminmax(t) if t.numel() else ()
    if not all(0 <= int(i) < vocab for i in extremes):
        raise SpeculantError(f"drafter proposed token ids outside the vocabulary (0..{vocab - 1})")
    if listed:
        return
    if prop.probs is not None and tuple(prop.probs.shape) != (batch, t.shape[1], vocab):
        raise SpeculantError(f"drafter returned q of shape {tuple(prop.probs.shape)}; expected "
                             f"{(batch, t.shape[1], vocab)} (rows, drafts, the target's vocabulary)")
    if prop.parents is not None:
        if prop.parents.shape != t.shape:
            raise SpeculantError(f"drafter returned a tree with parents of shape {tuple(prop.parents.shape)}; "
                                 f"expected {tuple(t.shape)} (one parent per node)")
        check_tree(prop.parents, prop.lengths)
