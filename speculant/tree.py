"""Token trees: shape checks and the masks, positions and contexts a tree pass needs.

A tree proposal holds, per row, nodes 0..N-1: ``tokens[b, i]`` hangs under ``parents[b, i]``, an
earlier node (parents[b, i] < i) or -1 for the root, the pass's first token (already decided).
Nodes at i >= lengths[b] are padding. In the verify block the root sits at position 0 and node i
at position i + 1; node i is *positioned* at depth(i) after the root, and attends to the cached
text, the root and its own ancestors only. A chain is the tree whose parents are i - 1.

Drafters that build trees best-first (suffix, ngram:tree) list nodes by decreasing score, so every
prefix of the node list is itself a tree: cutting a proposal to its first k nodes keeps it valid.
"""
from __future__ import annotations

import torch

from .errors import SpeculantError


def check_tree(parents: torch.Tensor, lengths: torch.Tensor) -> None:
    """One line naming what is wrong with a drafter's tree (parents must point to earlier nodes)."""
    for b, (row, n) in enumerate(zip(parents.tolist(), lengths.tolist())):  # lists: see below
        for i, p in enumerate(row[:n]):
            if not -1 <= p < i:
                raise SpeculantError(f"bad draft tree: node {i} of row {b} has parent {p}; a parent "
                                     f"must be an earlier node (0..{i - 1}) or -1 for the root")


def depths_of(row: list[int]) -> list[int]:
    """One row's node depths from its parent list (a padding node whose parent is not earlier:
    depth 2, where it points at or past itself; 1 under the root)."""
    d: list[int] = []
    for i, p in enumerate(row):
        d.append(d[p] + 1 if 0 <= p < i else 2 if p >= i else 1)
    return d


def _ancestry_of(row: list[int]) -> list[list[int]]:
    """One row's nodes each with its ancestors: [node, parent, ..., the root's child] (a padding
    node whose parent is not earlier: itself and that parent, if another)."""
    chains: list[list[int]] = []
    for i, p in enumerate(row):
        chains.append([i] + chains[p] if 0 <= p < i else [i, p] if p > i else [i])
    return chains


# Trees are a few dozen nodes a row: walked in Python lists after one copy off the device, where a
# loop of tensor ops a node cost ~15 us a node (a 15-node tree's layout ~0.6 ms of a CPU pass).

def depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] depth of each node below the root (children of the root: 1)."""
    return torch.tensor([depths_of(row) for row in parents.tolist()], dtype=torch.long,
                        device=parents.device).view(parents.shape)


def tree_depth(parents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B] the depth of each row's tree (its longest root-to-leaf path; 0 for no nodes)."""
    return torch.tensor(tree_depths(parents.tolist(), lengths.tolist()), dtype=torch.long, device=parents.device)


def tree_depths(parents: list[list[int]], lengths: list[int]) -> list[int]:
    """``tree_depth`` of parents and lengths as lists (a pass's bookkeeping: tensor ops run cold after a pass)."""
    return [max(depths_of(row)[:n], default=0) for row, n in zip(parents, lengths)]


def is_chain(parents: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Whether every row's tree is one chain: each real node under the one before it."""
    return all(row[:n] == list(range(-1, n - 1)) for row, n in zip(parents.tolist(), lengths.tolist()))


def block_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the verify block [root, node 0, ..., node N-1]: position offsets [B, N+1] (root 0,
    node i its depth) and visibility [B, N+1, N+1] (query t sees block slot s)."""
    B, N = parents.shape
    parent_rows = parents.tolist()  # one copy off the device for both walks
    offsets = torch.tensor([[0] + depths_of(row) for row in parent_rows], dtype=torch.long,
                           device=parents.device).view(B, N + 1)
    # as lists, then one tensor: node i (block slot i + 1) sees the root, itself and its ancestors
    vis = []
    for row in parent_rows:
        block = [[True] + [False] * N]
        for chain in _ancestry_of(row):
            sees = [False] * (N + 1)
            sees[0] = True
            for j in chain:
                sees[j + 1] = True
            block.append(sees)
        vis.append(block)
    return offsets, torch.tensor(vis, dtype=torch.bool, device=parents.device).view(B, N + 1, N + 1)


def path_block_index(path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Block positions [B, max n + 1] of the root and the accepted nodes (padded with the last one):
    where the scores that decided each emitted token sit."""
    counts = n.tolist()
    width = max(counts, default=0)
    rows = []
    for nodes, k in zip(path[:, :width].tolist(), counts):
        steps = [0] + [node + 1 for node in nodes[:k]]
        rows.append(steps + steps[-1:] * (width - k))
    return torch.tensor(rows, dtype=path.dtype, device=path.device).view(len(rows), width + 1)
