"""``X+ngram``: a tree drafter (EAGLE, Medusa) and prompt lookup, merged into one token tree.

A trained head predicts well where the answer is new text (chat, code, math) and poorly where it
copies its context (translation, summaries, RAG); prompt lookup is the other way round and costs
next to nothing. Each pass the tree drafter proposes its tree and ``ngram`` the continuation of the
latest match; the two are merged by token path (a path both propose once) and listed best first
by score, so the engine's controller keeps the nodes worth verifying from either.

Scores estimate each node's chance of being on the target's path. The tree drafter brings its
own; a lookup node at depth d scores α̂^d, where α̂ is the row's running share of lookup drafts
the target accepted, kept per grade of the chain (the length of the n-gram it matched: a 1-token
match is followed far less often than a 3-token one); a path both propose takes the larger
score. Scores never grow along a path, so best first lists every parent before its children and
any prefix is a tree. The lookup chain is drafted first and its scores are handed to the tree
drafter (``propose_among``): a head that grows its tree depth by depth stops once none of its
deeper nodes could beat them to the γ slots, so a chain the text keeps confirming (RAG,
summaries) spares most of the head's forwards. With γ auto, while the trees do not pay (a head
beside q8 on most text) the lookup's chains are drafted alone (``propose_lookup``,
controller.HybridGamma), as ``ngram`` would draft them.

Both drafts are deterministic functions of the accepted text (q one-hot), so greedy and sampled
verification stay exact.
"""
from __future__ import annotations

import torch

from ..errors import SpeculantError
from .base import DraftContext, Drafter, Proposal, common_prefix, tree_proposal
from .ngram import NgramDrafter

LOOKUP_DECAY = 0.9  # per pass: how fast a row's lookup acceptance estimate follows the text
PRIOR = (1.0, 2.0)  # a grade's lookup acceptance before its first chain: (hits, judged), Beta(1, 1)


def merge_trees(tree: tuple[list[int], list[int], list[float]], chain: list[int], chain_alpha: float,
                budget: int) -> tuple[list[int], list[int], list[float]]:
    """One row: a best-first tree (tokens, parents, scores) and a chain of lookup tokens -> their
    union by token path, the ``budget`` best nodes, best first (tokens, parents, scores)."""
    tokens, parents, scores = tree
    paths: list[tuple] = []
    score: dict[tuple, float] = {}
    for tok, par, sc in zip(tokens, parents, scores):
        path = (paths[par] if par >= 0 else ()) + (tok,)
        paths.append(path)
        score[path] = sc
    for d in range(1, len(chain) + 1):
        path = tuple(chain[:d])
        score[path] = max(score.get(path, 0.0), chain_alpha ** d)
    # best first: ties go to the shallower, so a parent (never below its child) comes first
    kept = sorted(score, key=lambda p: (-score[p], len(p)))[:budget]
    index = {p: i for i, p in enumerate(kept)}
    return [p[-1] for p in kept], [index[p[:-1]] if len(p) > 1 else -1 for p in kept], [score[p] for p in kept]


class HybridDrafter(Drafter):
    makes_trees = True
    has_lookup = True  # γ auto drafts the lookup alone while the trees do not pay (HybridGamma)
    lookup_only = False  # the last proposal was the lookup's alone

    def __init__(self, tree: Drafter, label: str | None = None):
        if not tree.makes_trees:
            raise SpeculantError(f"'{tree.describe()}+ngram': the drafter before +ngram must draft token trees "
                                 "(eagle, medusa)")
        self.tree, self.lookup = tree, NgramDrafter()
        self.name = f"{tree.name}+ngram"
        self.label = label or tree.describe()
        self.hidden_layers = tree.hidden_layers
        self.block_drafts = tree.block_drafts
        self.max_gamma = tree.max_gamma
        self.joins = tree.joins

    @property
    def deepens_with_budget(self) -> bool:  # the tree's, as it is now (an EAGLE head may draft its tree in PyTorch)
        return self.tree.deepens_with_budget

    def describe(self) -> str:
        return f"{self.label}+ngram"

    def join_refusal(self, fast_target: bool) -> str | None:
        return self.tree.join_refusal(fast_target)

    def state_bytes(self, rows: int, tokens: int) -> int:
        return self.tree.state_bytes(rows, tokens)

    @property
    def catchup_seconds(self) -> float:
        return 0.0 if self.lookup_only else self.tree.catchup_seconds

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.tree.start(ctx)
        self.lookup.start(ctx)
        rows = len(ctx.prompts)
        # lookup acceptance per row and grade: (hits, judged), a Beta(1, 1) prior
        self.lookup_alpha: list[dict[int, list[float]]] = [{} for _ in range(rows)]
        self.last_chain: list[tuple[list[int], int]] = [([], 0) for _ in range(rows)]
        self.lookup_only = False

    def propose_lookup(self, gamma: int) -> Proposal:
        """The lookup's chains alone (the tree drafter catches up on the text at its next proposal)."""
        self.lookup_only = True
        return self._lookup(gamma)[0]

    def _lookup(self, gamma: int) -> tuple[Proposal, list[list[int]]]:
        lookup = self.lookup.propose(gamma)
        chains = lookup.chains  # ListedChains: the lookup's own lists
        self.last_chain = list(zip(chains, lookup.grades))
        return lookup, chains

    def propose(self, gamma: int) -> Proposal:
        self.lookup_only = False
        lookup, chains = self._lookup(gamma)
        # the chain's node scores compete for the γ slots: a strong chain spares the tree's deep forwards
        alphas = [h / j for h, j in (row.get(g, PRIOR) for row, g in zip(self.lookup_alpha, lookup.grades))]
        rivals = None
        if self.tree.weighs_rivals:
            rivals = torch.zeros(len(chains), max(map(len, chains), default=0))
            for b, chain in enumerate(chains):
                rivals[b, : len(chain)] = alphas[b] ** torch.arange(1, len(chain) + 1)
        prop = self.tree.propose_among(gamma, rivals)
        n = prop.lengths.tolist()
        toks, pars = prop.tokens.tolist(), prop.parents.tolist()
        if prop.scores is not None:
            scs = prop.scores.float().tolist()
        else:  # a tree without scores: its own best-first order, as falling scores
            width = prop.tokens.shape[1]
            scs = [[1 - i / (width + 1) for i in range(width)]] * len(toks)
        trees = [merge_trees((toks[b][: n[b]], pars[b][: n[b]], scs[b][: n[b]]), chains[b], alphas[b], max(gamma, 1))
                 for b in range(len(chains))]
        return tree_proposal(trees, self.ctx.device)

    def observe_hidden(self, hidden) -> None:
        self.tree.observe_hidden(hidden)

    def update(self, new_tokens, n_accepted) -> None:
        for row, ((chain, grade), new) in enumerate(zip(self.last_chain, new_tokens)):
            if chain:  # how far the lookup chain ran along what the target accepted
                m = common_prefix(chain, new)
                hits, judged = self.lookup_alpha[row].get(grade, PRIOR)
                self.lookup_alpha[row][grade] = [LOOKUP_DECAY * hits + m,
                                                 LOOKUP_DECAY * judged + min(m + 1, len(chain), len(new))]
        self.last_chain = [([], 0) for _ in new_tokens]
        self.tree.update(new_tokens, n_accepted)
        self.lookup.update(new_tokens, n_accepted)

    # per-row state (PerRow): both inner drafters' rows, and how well the lookup does per row
    row_fields = ("tree", "lookup", "lookup_alpha", "last_chain")

    def fork(self) -> "HybridDrafter":
        other = super().fork()
        other.tree, other.lookup = self.tree.fork(), self.lookup.fork()
        return other

    def finish(self) -> None:
        self.tree.finish()
        self.lookup.finish()
