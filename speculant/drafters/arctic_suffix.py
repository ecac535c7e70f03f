"""``suffix:arctic``: ArcticInference's ``SuffixDecodingCache`` (what vLLM's ``method="suffix"`` runs)
behind speculant's drafter interface, to put the reference implementation beside ``suffix``.

It needs ArcticInference's compiled suffix module, which PyPI ships only as source that builds
against torch >= 2.10 with nanobind and CMake (docs/drafters.md: "Token trees and suffix"); without it this
drafter says so in one line. Settings are vLLM's defaults (tree depth 24, spec factor 1.0, min
token probability 0.1, tree speculation on). q is one-hot.
"""
from __future__ import annotations

import itertools

from ..errors import SpeculantError
from .base import DraftContext, Drafter, Proposal, tree_proposal

_CACHE = None
_IDS = itertools.count()
HOW_TO = ("suffix:arctic needs ArcticInference's suffix module (import arctic_inference.suffix_decoding): "
          "build arctic-inference 0.3.0 from source as docs/drafters.md describes, or use --drafter suffix")


def available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401  (built from source apart: see HOW_TO)
    except ImportError:
        return False
    return True


class ArcticSuffixDrafter(Drafter):
    name = "suffix:arctic"
    makes_trees = True
    free_drafts = True

    def __init__(self, max_depth: int = 24, spec_factor: float = 1.0, spec_offset: float = 0.0,
                 min_prob: float = 0.1, max_cached_requests: int = 10_000):
        global _CACHE
        if not available():
            raise SpeculantError(HOW_TO)
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # built from source apart: see HOW_TO

        if _CACHE is None or _CACHE.max_tree_depth != max_depth:
            _CACHE = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)
        self.cache = _CACHE
        self.max_depth, self.spec_factor, self.spec_offset, self.min_prob = max_depth, spec_factor, spec_offset, min_prob
        self.forget_same_prompt = False  # the bench sets it, as for ``suffix``
        self.by_prompt: dict[int, list] = {}
        self.ids: list = []

    def fork(self) -> "ArcticSuffixDrafter":
        twin = super().fork()
        twin.ids, twin.texts = [], []  # its own requests in the shared cache (start opens them)
        return twin

    def finish(self) -> None:
        for rid in self.ids:  # the batch's open requests become cached responses
            if rid in self.cache.active_requests:
                self.cache.stop_request(rid)
        self.ids, self.texts = [], []

    def start(self, ctx: DraftContext) -> None:
        self.finish()  # rows still open from an earlier request
        self.device = ctx.device
        for prompt in ctx.prompts:
            key = hash(tuple(prompt))
            if self.forget_same_prompt:
                for old in self.by_prompt.pop(key, []):
                    if old in self.cache.cached_requests:
                        self.cache.evict_cached_response(old)
            rid = next(_IDS)
            self.by_prompt.setdefault(key, []).append(rid)
            self.cache.start_request(rid, list(prompt))
            self.ids.append(rid)
            self.texts.append(list(prompt))

    def update(self, new_tokens, n_accepted) -> None:
        for rid, text, toks in zip(self.ids, self.texts, new_tokens):
            if toks:
                self.cache.add_active_response(rid, toks)
                text.extend(toks)

    why_no_join = "arctic_inference's suffix cache holds the requests this batch registered at its start"
    row_fields = ("texts",)  # per-row state (PerRow); the ids close their requests as rows leave

    def _select_more(self, rows) -> None:
        keep = set(rows)
        for i, rid in enumerate(self.ids):
            if i not in keep:
                self.cache.stop_request(rid)
        self.ids = [self.ids[r] for r in rows]

    def propose(self, gamma: int) -> Proposal:
        trees = []
        for rid, text in zip(self.ids, self.texts):
            d = self.cache.speculate(rid, text[-self.max_depth:], max_spec_tokens=gamma,
                                     max_spec_factor=self.spec_factor, max_spec_offset=self.spec_offset,
                                     min_token_prob=self.min_prob, use_tree_spec=True)
            trees.append((list(d.token_ids), list(d.parents), list(d.probs)))
        return tree_proposal(trees, self.device)
