"""``ngram``: model-free prompt lookup (Saxena 2023). Find the latest earlier occurrence of the
last n tokens of prompt + output and propose what followed it. Deterministic, so its q is one-hot.

An index from each n-gram to where its recent continuations start is kept up to date as tokens
arrive, so a proposal costs O(max_ngram) per row, not a scan of the text.

``ngram:tree`` proposes the continuations of the longest matching n-gram's last ``tree_matches``
occurrences at once, merged into a token tree (shared prefixes once), each node scored by the
share of those occurrences that continue through it, best first.

A chain proposal is graded by the length of the n-gram it matched: on chat text a 1-token match
is followed ~20% of the time, a 3-token one ~80% (SmolLM2, 64 bench answers), so γ auto learns
acceptance per grade and drafts long only where the match is strong.
"""
from __future__ import annotations

from .base import DraftContext, Drafter, ListedChains, Proposal, tree_proposal
from .spec import DrafterKind


class NgramDrafter(Drafter):
    name = "ngram"
    free_drafts = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: bool = False, tree_matches: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes must satisfy 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree, self.tree_matches = tree, tree_matches
        self.makes_trees = tree
        self.name = "ngram:tree" if tree else "ngram"

    def start(self, ctx: DraftContext) -> None:
        self.device = ctx.device
        self.texts: list[list[int]] = []
        self.index: list[dict[tuple, list[int]]] = []
        for prompt in ctx.prompts:
            self.texts.append([])
            self.index.append({})
            self._extend(len(self.texts) - 1, prompt)

    def _extend(self, row: int, tokens: list[int]) -> None:
        text, index = self.texts[row], self.index[row]
        keep = self.tree_matches if self.tree else 1
        for tok in tokens:
            k = len(text)  # tok lands at position k: it continues every n-gram ending at k-1
            for n in range(self.min_ngram, self.max_ngram + 1):
                if k >= n:
                    starts = index.setdefault(tuple(text[k - n : k]), [])
                    starts.append(k)
                    if len(starts) > keep:
                        del starts[0]
            text.append(tok)

    def _matches(self, row: int, tail: list[int]) -> tuple[list[int], int]:
        """Where the longest n-gram ending ``tail`` continued, latest last (indices into the text),
        and that n-gram's length (0: no match)."""
        index = self.index[row]
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            starts = index.get(tuple(tail[-n:]))
            if starts:
                return starts, n
        return [], 0

    def _lookup(self, row: int, gamma: int) -> tuple[list[int], int]:
        """Copy what followed the latest match; when that runs into the end of the text (a repeating
        pattern's latest occurrence is right behind us), look up again from the extended text, so a
        period repeats itself instead of the proposal stopping short. Returns the draft and the
        length of the n-gram its first token was matched by (its grade)."""
        text, out, grade = self.texts[row], [], 0
        while len(out) < gamma:
            starts, n = self._matches(row, (text[-self.max_ngram :] + out)[-self.max_ngram :])
            if not starts:
                break
            grade = grade or n
            out.extend(text[starts[-1] : starts[-1] + gamma - len(out)])
        return out, grade

    def _tree(self, row: int, budget: int):
        """The continuations of the last few matches as one tree: (tokens, parents, scores), best first."""
        text = self.texts[row]
        starts = [s for s in self._matches(row, text[-self.max_ngram :])[0] if s < len(text)]
        if not starts:
            return [], [], []
        trie: dict[tuple, int] = {}  # path of tokens -> how many continuations pass through it
        for s in starts:
            cont = text[s : s + budget]
            for d in range(1, len(cont) + 1):
                trie[tuple(cont[:d])] = trie.get(tuple(cont[:d]), 0) + 1
        # best first: by share of matches, deeper after shallower on ties, so parents come first
        kept = sorted(trie, key=lambda path: (-trie[path], len(path)))[:budget]
        index = {path: i for i, path in enumerate(kept)}
        return ([path[-1] for path in kept], [index.get(path[:-1], -1) for path in kept],
                [trie[path] / len(starts) for path in kept])

    def propose(self, gamma: int) -> Proposal:
        if self.tree:
            return tree_proposal([self._tree(row, gamma) for row in range(len(self.texts))], self.device)
        found, grades = zip(*[self._lookup(row, gamma) for row in range(len(self.texts))]) if self.texts else ((), ())
        return ListedChains(list(found), gamma, self.device, list(grades))  # tensors only if verified

    def update(self, new_tokens, n_accepted) -> None:
        for row, toks in enumerate(new_tokens):
            self._extend(row, toks)

    row_fields = ("texts", "index")  # per-row state (PerRow)
    joins = True


def _vllm(spec, fixed):
    # ngram:tree has no vLLM twin: its chain form (the latest match) is what vLLM runs
    return {"method": "ngram", "num_speculative_tokens": fixed or 16, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


NGRAM = DrafterKind("ngram", "ngram | ngram:tree", lambda spec, b: NgramDrafter(tree=spec.arg == "tree"),
                    exact=("ngram", "ngram:tree"), vllm=_vllm)
