"""The drafter interface: the engine talks to every drafter through these methods only (start, propose,
update; observe_hidden for drafters that read the target's hidden states; fork and finish for batches
that run side by side and end). Rows leaving and joining: a drafter declares its per-row fields
(``row_fields``, speculant/rows.py) and the batch keeps or appends them (``select`` / ``join``)."""
from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..rows import PerRow
from ..sampling import LogitsProcessing


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the Python that launched them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_since(t0: float, device: torch.device) -> float:
    """Wall seconds since ``t0`` (a ``time.perf_counter()``) once the device's queued work is done."""
    sync(device)
    return time.perf_counter() - t0


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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


@dataclass
class Proposal:
    """A chain of draft tokens per row, or a token tree (``parents`` set; see speculant/tree.py)."""

    tokens: torch.Tensor  # [B, γ] draft tokens (padded past each row's length); tree: one per node
    lengths: torch.Tensor  # [B] real drafts (nodes) per row (0 = nothing to propose for that row)
    probs: torch.Tensor | None = None  # [B, γ, V] processed q the drafts were sampled from; None = one-hot
    # a tree: node i hangs under parents[b, i] < i (-1: under the pass's first token). Tree
    # drafters list nodes best first (each node after its parent), so a prefix is a tree too.
    parents: torch.Tensor | None = None  # [B, γ]
    scores: torch.Tensor | None = None  # [B, γ] the drafter's estimate that the target's text passes each node
    # a chain's grade per row, as the drafter sees its evidence (ngram: the matched n-gram's length):
    # γ auto keeps acceptance per grade, so weak drafts go unverified and strong ones run long
    grades: list[int] | None = None

    def row_lengths(self) -> list[int]:
        """``lengths`` as a list."""
        return self.lengths.tolist()

    def columns(self) -> int:
        """The draft columns (``tokens.shape[1]``)."""
        return self.tokens.shape[1]


class ListedChains(Proposal):
    """Chains a drafter holds as lists (a lookup's), padded to ``width`` columns: the ``tokens`` and
    ``lengths`` tensors are made when first read. γ auto verifies most lookups not at all (weak
    matches stay unverified: 3 passes in 4 or more on chat, code and QA), and two tensors made
    after a pass has streamed the weights cost ~0.1 ms of a ~4.5 ms q8 pass."""

    def __init__(self, chains: list[list[int]], width: int, device, grades: list[int] | None = None):
        self.chains, self.width, self.device, self.grades = chains, width, device, grades
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def _made(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is None:
            padded = [t for chain in self.chains for t in chain + [0] * (self.width - len(chain))]
            tokens = torch.tensor(padded, dtype=torch.long, device=self.device).view(len(self.chains), self.width)
            lengths = torch.tensor(self.row_lengths(), dtype=torch.long, device=self.device)
            self._tensors = tokens, lengths
        return self._tensors

    @property
    def tokens(self) -> torch.Tensor:
        return self._made()[0]

    @property
    def lengths(self) -> torch.Tensor:
        return self._made()[1]

    def row_lengths(self) -> list[int]:
        return [len(chain) for chain in self.chains]

    def columns(self) -> int:
        return self.width


def draft_slots(ctx, history, logits: torch.Tensor, n: int) -> Proposal:
    """A block's n draft tokens from its slots' logits [B, >=n, V] (DFlash, P-EAGLE): each slot's q
    processed with the drafts before it as context (``history``: a TokenHistory, or None)."""
    proc, dev, B = ctx.processing, ctx.device, logits.shape[0]
    drafts = torch.zeros(B, n, dtype=torch.long, device=dev)
    probs = [] if not proc.greedy else None
    for j in range(n):
        context = history.after(drafts[:, :j]) if history is not None else None
        tok, q = proc.pick(logits[:, j], context, ctx.generator, ctx.seeded, j)
        drafts[:, j] = tok
        if probs is not None:
            probs.append(q)
    lengths = torch.full((B,), n, dtype=torch.long, device=dev)
    return Proposal(drafts, lengths, torch.stack(probs, 1) if probs else None)


def tree_proposal(trees: list[tuple[list[int], list[int], list[float]]], device) -> Proposal:
    """Per row (tokens, parents, scores) of a best-first tree -> a padded tree Proposal (one-hot q)."""
    B, width = len(trees), max((len(t[0]) for t in trees), default=0)

    def padded(column: int, fill, dtype) -> torch.Tensor:  # one tensor a field, from lists (small ops run cold)
        flat = [x for tree in trees for x in list(tree[column]) + [fill] * (width - len(tree[column]))]
        return torch.tensor(flat, dtype=dtype, device=device).view(B, width)

    lengths = torch.tensor([len(t[0]) for t in trees], dtype=torch.long, device=device)
    return Proposal(padded(0, 0, torch.long), lengths, None, padded(1, -1, torch.long), padded(2, 0.0, torch.float32))


@dataclass
class DraftContext:
    """What a drafter is given at the start of a generation."""

    prompts: list[list[int]]
    processing: LogitsProcessing  # the same processing the target's p goes through
    generator: torch.Generator | None
    device: torch.device
    vocab_size: int  # the target's: q must have this width
    max_tokens: int | None = None  # an upper bound on any row's length (sizes static caches)
    target_state: object | None = None  # the target's KV state, for a drafter that shares it (layerskip)
    # per row, the target's hidden states at the drafter's ``hidden_layers`` for every prompt token
    # [prompt length, len(hidden_layers), H]; None unless the drafter asks for hidden states
    prompt_hidden: list | None = None
    # sampling: which rows are seeded (they choose with noise of their own: pass it to processing.pick)
    seeded: object | None = None


class Drafter(PerRow, ABC):
    """A drafter's per-row state is declared, not handled by hand: ``row_fields`` names the
    attributes with one entry per row (tensors with rows on dim 0, lists, a TokenHistory or an inner
    drafter), ``layer_fields`` lists of them per layer (caches of different sizes are padded to the
    larger on join); ``select`` and ``join`` (speculant/rows.py) keep or append them all. Logic no
    field expresses goes in ``_select_more`` / ``_join_more``."""

    name: str = "drafter"
    # proposes token trees: the engine asks for its whole budget, then keeps the best nodes
    makes_trees: bool = False
    # proposing costs next to nothing and does not grow with the draft's length (model-free drafters)
    free_drafts: bool = False
    # never proposes a token (``none``): every pass is a plain one, with no γ to choose
    drafts_nothing: bool = False
    # the target layers whose hidden states this drafter reads (trained drafters): the verify pass
    # returns them at no extra pass (id L < target layers: the input of layer L; id = target layers:
    # the final normed state) and the engine hands over those of the tokens it accepted
    hidden_layers: tuple = ()
    # one forward drafts a whole block (DFlash): its cost is per pass, whatever γ
    block_drafts: bool = False
    # a tree drafter whose proposal costs more the more nodes it is asked for (an EAGLE chain on
    # the CPU kernels: a head step a level): gamma="auto" asks it for about the nodes it verifies
    deepens_with_budget: bool = False
    # proposes a prompt lookup's chain alone too (``propose_lookup``: X+ngram), which costs nothing:
    # gamma="auto" drafts it while the drafter's trees do not pay
    has_lookup: bool = False
    # the most draft tokens one proposal can hold (a block drafter: its block size - 1); None: any
    max_gamma: int | None = None
    # seconds of the last ``propose`` spent on one-off catch-up (a lazy prompt prefill): gamma="auto"
    # leaves them out of the drafter's per-token cost
    catchup_seconds: float = 0.0

    @abstractmethod
    def start(self, ctx: DraftContext) -> None:
        """A new batch of prompts begins."""

    def state_bytes(self, rows: int, tokens: int) -> int:
        """About the bytes a batch of ``rows`` rows of up to ``tokens`` tokens makes this drafter
        hold (its caches), for the per-request memory budget; model-free drafters hold next to none."""
        return 0

    @abstractmethod
    def propose(self, gamma: int) -> Proposal:
        """Up to γ draft tokens per row continuing the accepted text."""

    # whether ``propose_among``'s rivals change this drafter's proposal (else a caller need not make them)
    weighs_rivals = False

    def propose_among(self, gamma: int, rivals: torch.Tensor | None) -> Proposal:
        """``propose`` when other nodes compete for the same γ slots of a merged tree: ``rivals``
        [B, R] are their scores (probabilities; 0 pads; None: none). A drafter that grows its tree
        step by step may stop once no further node of its own could enter the best γ
        (``weighs_rivals``); by default the rivals change nothing."""
        return self.propose(gamma)

    def propose_lookup(self, gamma: int) -> Proposal:
        """A drafter with ``has_lookup``: its prompt lookup's chains alone (up to γ tokens a row)."""
        raise NotImplementedError(f"{self.describe()} has no lookup of its own")

    @abstractmethod
    def update(self, new_tokens: list[list[int]], n_accepted: list[int]) -> None:
        """The target accepted ``n_accepted[b]`` of row b's last drafts; ``new_tokens[b]`` is what
        row b's text grew by (those drafts plus the target's own token)."""

    def observe_hidden(self, hidden: list[torch.Tensor]) -> None:
        """hidden[b]: the target's hidden states [m, len(hidden_layers), H] of the m tokens row b's
        last pass put in the target's cache (the pass's first token and the accepted drafts), in
        order. Called before ``update`` and only for drafters with ``hidden_layers``."""

    def describe(self) -> str:
        return self.name

    # rows of another batch (this drafter's fork, started on them) can join: its row fields say all
    joins: bool = False
    # where they cannot, why (the server says it as it starts: such requests batch in waves)
    why_no_join: str = "its per-row state is not all declared in row fields"

    def join_refusal(self, fast_target: bool) -> str | None:
        """Why rows of another batch cannot join a running batch of this drafter's (None: they can),
        beside a target on the fast path (``fast_target``) or the general one."""
        return None if self.joins else self.why_no_join

    def fork(self) -> "Drafter":
        """A drafter with the same weights and settings for another batch (its state comes with start)."""
        return copy.copy(self)

    def finish(self) -> None:
        """The batch is over: give back what it held (caches)."""
