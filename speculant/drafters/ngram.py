"""``ngram``: model-free prompt lookup (Saxena 2023). Find the latest earlier occurrence of the
last n tokens of prompt + output and propose what followed it. Deterministic, so its q is one-hot.

An index from each n-gram to where its most recent continuation starts is kept up to date as
tokens arrive, so a proposal costs O(max_ngram) per row, not a scan of the text.
"""
from __future__ import annotations

import torch

from .base import DraftContext, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes must satisfy 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, ctx: DraftContext) -> None:
        self.device = ctx.device
        self.texts: list[list[int]] = []
        self.index: list[dict[tuple, int]] = []
        for prompt in ctx.prompts:
            self.texts.append([])
            self.index.append({})
            self._extend(len(self.texts) - 1, prompt)

    def _extend(self, row: int, tokens: list[int]) -> None:
        text, index = self.texts[row], self.index[row]
        for tok in tokens:
            k = len(text)  # tok lands at position k: it continues every n-gram ending at k-1
            for n in range(self.min_ngram, self.max_ngram + 1):
                if k >= n:
                    index[tuple(text[k - n : k])] = k
            text.append(tok)

    def _match(self, row: int, tail: list[int]) -> int | None:
        """Where the longest n-gram ending ``tail`` last continued (an index into the row's text)."""
        index = self.index[row]
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            at = index.get(tuple(tail[-n:]))
            if at is not None:
                return at
        return None

    def _lookup(self, row: int, gamma: int) -> list[int]:
        """Copy what followed the latest match; when that runs into the end of the text (a repeating
        pattern's latest occurrence is right behind us), look up again from the extended text, so a
        period repeats itself instead of the proposal stopping short."""
        text, out = self.texts[row], []
        while len(out) < gamma:
            at = self._match(row, (text[-self.max_ngram :] + out)[-self.max_ngram :])
            if at is None:
                break
            out.extend(text[at : at + gamma - len(out)])
        return out

    def propose(self, gamma: int) -> Proposal:
        found = [self._lookup(row, gamma) for row in range(len(self.texts))]
        tokens = torch.zeros(len(found), gamma, dtype=torch.long)
        for row, cont in enumerate(found):
            tokens[row, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        lengths = torch.tensor([len(c) for c in found], dtype=torch.long)
        return Proposal(tokens.to(self.device), lengths.to(self.device), None)

    def update(self, new_tokens, n_accepted) -> None:
        for row, toks in enumerate(new_tokens):
            self._extend(row, toks)

    def select(self, rows) -> None:
        self.texts = [self.texts[r] for r in rows]
        self.index = [self.index[r] for r in rows]
