"""``suffix``: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975), model-free token trees.

Per request row, a suffix trie over its prompt and output so far; per process, one bounded trie
over earlier outputs (shared by every ``suffix`` drafter of the same tokenizer). Each pass matches
the latest text's suffixes in both, and from a matched context of m tokens drafts the most likely
continuations as a tree (best first by estimated chance = continuation count / context count,
nodes below ``min_prob`` dropped), at most ``spec_factor * m + spec_offset`` nodes: longer matches,
deeper trees (the paper's MAX_SPEC = α·p). Of the drafts from the few longest matches in either
trie, the one with the highest expected accepted length (sum of chances) is proposed. q is one-hot
(a deterministic drafter), so verification stays exact.

The process-wide trie keeps at most ``SUFFIX_CACHE_TOKENS`` tokens of earlier outputs (env var;
default 50,000) and evicts whole outputs, least recently written first (ArcticInference evicts
oldest first too). Its key is the tokenizer (token ids of different vocabularies never mix).
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict

from ..errors import SpeculantError
from . import arctic_suffix
from .base import DraftContext, Drafter, Proposal, tree_proposal
from .spec import Build, DrafterKind, DrafterSpec
from .suffix_trie import Draft, SuffixTrie

DEFAULT_CACHE_TOKENS = 50_000


class SharedOutputs:
    """The process-wide suffix trie over earlier requests' outputs, bounded in tokens."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.trie = SuffixTrie(max_depth)
        self.max_tokens = max_tokens
        self.order: OrderedDict = OrderedDict()  # sequence -> prompt key, least recently written first

    def extend(self, seq, tokens: list[int], prompt_key=None) -> None:
        if self.max_tokens <= 0:
            return
        self.trie.extend(seq, tokens)
        self.order[seq] = prompt_key
        self.order.move_to_end(seq)
        while self.trie.tokens > self.max_tokens and len(self.order) > 1:
            oldest = next(iter(self.order))
            if oldest == seq:
                break
            self.forget(oldest)

    def forget(self, seq) -> None:
        self.order.pop(seq, None)
        self.trie.remove(seq)

    def forget_prompt(self, prompt_key) -> None:
        """Drop every output written for this prompt (the bench: a request never drafts from an
        earlier run of itself)."""
        for seq in [s for s, key in self.order.items() if key == prompt_key]:
            self.forget(seq)


_SHARED: dict[object, SharedOutputs] = {}
_SEQ_IDS = itertools.count()


def shared_outputs(corpus, max_depth: int) -> SharedOutputs:
    key = (corpus, max_depth)
    if key not in _SHARED:
        limit = int(os.environ.get("SUFFIX_CACHE_TOKENS", DEFAULT_CACHE_TOKENS))
        _SHARED[key] = SharedOutputs(max_depth, limit)
    return _SHARED[key]


class SuffixDrafter(Drafter):
    name = "suffix"
    makes_trees = True
    free_drafts = True

    def __init__(self, corpus="default", max_depth: int = 32, spec_factor: float = 1.0, spec_offset: float = 0.0,
                 min_prob: float = 0.1, matches_tried: int = 3, share: bool = True):
        self.corpus, self.max_depth = corpus, max_depth
        self.spec_factor, self.spec_offset, self.min_prob = spec_factor, spec_offset, min_prob
        self.matches_tried = matches_tried
        self.share = share
        self.forget_same_prompt = False  # the bench sets it: no drafting from earlier runs of a prompt

    def describe(self) -> str:
        return "suffix" if self.share else "suffix (no cross-request cache)"

    def start(self, ctx: DraftContext) -> None:
        self.device = ctx.device
        self.shared = shared_outputs((self.corpus, ctx.vocab_size), self.max_depth) if self.share else None
        self.local: list[SuffixTrie] = []
        self.texts: list[list[int]] = []
        self.seqs, self.prompt_keys = [], []
        for prompt in ctx.prompts:
            trie = SuffixTrie(self.max_depth)
            trie.extend(0, prompt)
            self.local.append(trie)
            self.texts.append(trie.seqs[0])
            self.seqs.append(("out", next(_SEQ_IDS)))
            key = hash(tuple(prompt))
            self.prompt_keys.append(key)
            if self.shared is not None and self.forget_same_prompt:
                self.shared.forget_prompt(key)

    def update(self, new_tokens, n_accepted) -> None:
        for row, toks in enumerate(new_tokens):
            if toks:
                self.local[row].extend(0, toks)
                if self.shared is not None:
                    self.shared.extend(self.seqs[row], toks, self.prompt_keys[row])

    row_fields = ("local", "texts", "seqs", "prompt_keys")  # per-row state (PerRow)
    joins = True

    def _best(self, row: int, budget: int) -> Draft:
        """The draft with the highest expected accepted length over the matched context lengths of
        both tries. A draft from a match of m tokens has at most min(budget, spec_factor·m +
        spec_offset, max_depth - m) nodes, each of chance <= 1, so lengths whose bound cannot beat
        the best draft so far are skipped (the longest matches leave the least depth below them)."""
        local = self.local[row]
        candidates = [(local, node, m) for m, node in enumerate(local.own_matches(0), 1)]
        if self.shared is not None and self.shared.trie.tokens:
            shared = self.shared.trie
            candidates += [(shared, node, m) for m, node in enumerate(shared.match(self.texts[row]), 1)]
        bounded = []
        for trie, node, m in candidates:
            limit = min(budget, int(self.spec_factor * m + self.spec_offset + 1e-6), self.max_depth - m)
            if limit > 0 and trie.has_continuation(node):
                bounded.append((limit, m, trie, node))
        best = Draft()
        for limit, m, trie, node in sorted(bounded, key=lambda c: (-c[0], -c[1]))[: self.matches_tried * 4]:
            if limit <= best.score:
                break
            draft = trie.draft(node, m, limit, self.min_prob)
            if draft.score > best.score:
                best = draft
        return best

    def propose(self, gamma: int) -> Proposal:
        drafts = [self._best(row, gamma) for row in range(len(self.local))]
        return tree_proposal([(d.tokens, d.parents, d.probs) for d in drafts], self.device)


def _check(spec: DrafterSpec) -> None:
    if spec.arg == "arctic" and not arctic_suffix.available():
        raise SpeculantError(arctic_suffix.HOW_TO)


def _make(spec: DrafterSpec, b: Build) -> Drafter:
    if spec.arg == "arctic":
        return arctic_suffix.ArcticSuffixDrafter()
    tok = b.target.tokenizer
    return SuffixDrafter(corpus=(tok.name_or_path if tok is not None else b.target.name,
                                 len(tok) if tok is not None else None))


def _vllm(spec: DrafterSpec, fixed: int | None) -> dict:
    d = SuffixDrafter()
    depth = 24 if spec.arg == "arctic" else d.max_depth
    return {"method": "suffix", "num_speculative_tokens": fixed or 32, "suffix_decoding_max_tree_depth": depth,
            "suffix_decoding_max_spec_factor": d.spec_factor, "suffix_decoding_min_token_prob": d.min_prob}


SUFFIX = DrafterKind("suffix", "suffix | suffix:arctic", _make, exact=("suffix", "suffix:arctic"), check=_check,
                     vllm=_vllm)
