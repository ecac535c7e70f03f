"""A depth-limited suffix trie with occurrence counts: the structure behind ``--drafter suffix``
(SuffixDecoding, Oliaro et al. 2024; ArcticInference's ``SuffixTree`` without path compression).

Every suffix of every stored sequence is inserted up to ``max_depth`` tokens, so the node reached
by a token string s counts how often s occurs. Appending a token extends the (at most max_depth)
suffixes that end at the sequence's end: O(max_depth) steps. The children of the node matching
the latest context, with their counts, are the continuations seen after it; their counts over the
node's estimate how likely each continuation is.

Storage is compact because most nodes lie on unbranching paths: per node four 32-bit integers
(count, depth, its first child's token and id) in arrays, and a dictionary only for the other
children of a branching node (~0.6 KB per stored token at depth 32, against ~7 KB with a
dictionary per node). Sequences can be removed (their suffixes' counts go down, nodes at zero are
freed), which is what the process-wide cache's eviction does.
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass, field


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index of each token's parent, -1: the root
    probs: list[float] = field(default_factory=list)  # estimated chance the text passes each node
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected tokens accepted if the estimates are right (the sum of the node chances)."""
        return sum(self.probs)


class SuffixTrie:
    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2")
        self.max_depth = max_depth
        self.count = array("i", [0])
        self.depth = array("i", [0])
        self.first_token = array("i", [-1])  # -1: no child
        self.first_child = array("i", [-1])
        self.more: dict[int, dict[int, int]] = {}  # node -> {token: child} beyond its first child
        self.free: list[int] = []  # node ids to reuse
        self.seqs: dict[object, list[int]] = {}
        self.ends: dict[object, list[int]] = {}  # per sequence: nodes of the suffixes ending at its end
        self.tokens = 0  # stored tokens, all sequences

    @property
    def nodes(self) -> int:
        return len(self.count) - len(self.free)

    def children(self, node: int):
        """(token, child) pairs of a node."""
        if self.first_token[node] >= 0:
            yield self.first_token[node], self.first_child[node]
            extra = self.more.get(node)
            if extra:
                yield from extra.items()

    def child(self, node: int, token: int) -> int:
        """The child of ``node`` through ``token``, or -1."""
        if self.first_token[node] == token:
            return self.first_child[node]
        extra = self.more.get(node)
        return extra.get(token, -1) if extra else -1

    def has_continuation(self, node: int) -> bool:
        return self.first_token[node] >= 0

    def _new_node(self, depth: int) -> int:
        if self.free:
            n = self.free.pop()
            self.count[n], self.depth[n], self.first_token[n], self.first_child[n] = 0, depth, -1, -1
            return n
        for a, v in ((self.count, 0), (self.depth, depth), (self.first_token, -1), (self.first_child, -1)):
            a.append(v)
        return len(self.count) - 1

    def _child_or_new(self, node: int, token: int) -> int:
        child = self.child(node, token)
        if child >= 0:
            return child
        child = self._new_node(self.depth[node] + 1)
        if self.first_token[node] < 0:
            self.first_token[node], self.first_child[node] = token, child
        else:
            self.more.setdefault(node, {})[token] = child
        return child

    def extend(self, seq, tokens) -> None:
        """Append tokens to sequence ``seq`` (a new sequence if unknown)."""
        text = self.seqs.setdefault(seq, [])
        ends = self.ends.setdefault(seq, [])
        count, depth, limit = self.count, self.depth, self.max_depth
        for tok in tokens:
            text.append(tok)
            new = []
            for node in [0] + ends:  # extend every suffix ending here by one token
                if depth[node] < limit:
                    child = self._child_or_new(node, tok)
                    count[child] += 1
                    new.append(child)
            count[0] += 1
            ends[:] = new
        self.tokens += len(tokens)

    def _unlink(self, node: int, token: int) -> None:
        extra = self.more.get(node)
        if self.first_token[node] == token:
            if extra:  # promote another child to first
                tok, child = extra.popitem()
                self.first_token[node], self.first_child[node] = tok, child
            else:
                self.first_token[node], self.first_child[node] = -1, -1
        elif extra:
            del extra[token]
        if extra is not None and not extra:
            del self.more[node]

    def remove(self, seq) -> None:
        """Forget sequence ``seq``: every suffix it inserted loses one count; empty nodes are freed
        (a node's count bounds its descendants', so everything below an empty node is empty too)."""
        text = self.seqs.pop(seq, None)
        self.ends.pop(seq, None)
        if text is None:
            return
        self.tokens -= len(text)
        self.count[0] -= len(text)
        for start in range(len(text)):
            node = 0
            for tok in text[start : start + self.max_depth]:
                child = self.child(node, tok)
                self.count[child] -= 1
                if self.count[child] == 0:
                    self._unlink(node, tok)
                    self._free_subtree(child)
                    break
                node = child

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(c for _, c in self.children(n))
            self.more.pop(n, None)
            self.first_token[n], self.first_child[n] = -1, -1
            self.free.append(n)

    def match(self, context: list[int]) -> list[int]:
        """Nodes of the context's suffixes that occur in the trie, shortest first: entry m-1 matches
        the last m tokens. Stops at the first length that does not occur (no longer one can)."""
        out = []
        tail = context[-(self.max_depth - 1):]
        for m in range(1, len(tail) + 1):
            node = 0
            for tok in tail[-m:]:
                node = self.child(node, tok)
                if node < 0:
                    return out
            out.append(node)
        return out

    def own_matches(self, seq) -> list[int]:
        """``match`` of sequence ``seq``'s own end, for free: the nodes its last insertion reached
        (the longest ones may have occurred only there, with nothing after them yet)."""
        return list(self.ends.get(seq, []))

    def draft(self, node: int, match_len: int, max_tokens: int, min_prob: float) -> Draft:
        """The most likely continuations after ``node``, best first: a heap on each continuation's
        estimated chance (the product, along its path, of each token's count over its siblings'),
        which only falls along a path, so parents come before children and every prefix of the
        draft is a tree."""
        out = Draft(match_len=match_len)
        heap: list[tuple[float, int, int, int, int]] = []  # (-chance, tie-break, node, token, parent)
        tick = 0

        def push_children(at: int, chance: float, parent: int) -> None:
            nonlocal tick
            kids = list(self.children(at))
            total = sum(self.count[c] for _, c in kids)  # occurrences that continue (not at an end)
            for tok, child in kids:
                c = chance * self.count[child] / total
                if c >= min_prob:
                    tick += 1
                    heapq.heappush(heap, (-c, tick, child, tok, parent))

        push_children(node, 1.0, -1)
        while heap and len(out.tokens) < max_tokens:
            neg, _, at, tok, parent = heapq.heappop(heap)
            out.tokens.append(tok)
            out.parents.append(parent)
            out.probs.append(-neg)
            push_children(at, -neg, len(out.tokens) - 1)
        return out
