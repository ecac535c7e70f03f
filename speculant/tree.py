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
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)[None]
    real = idx < lengths[:, None]
    bad = real & ((parents >= idx) | (parents < -1))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise SpeculantError(f"bad draft tree: node {i} of row {b} has parent {int(parents[b, i])}; a parent "
                             f"must be an earlier node (0..{i - 1}) or -1 for the root")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] depth of each node below the root (children of the root: 1)."""
    B, N = parents.shape
    out = torch.ones(B, N, dtype=torch.long, device=parents.device)
    for i in range(N):
        p = parents[:, i]
        has = p >= 0
        if bool(has.any()):
            out[:, i] = torch.where(has, out.gather(1, p.clamp_min(0)[:, None]).squeeze(1) + 1, out[:, i])
    return out


def tree_depth(parents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B] the depth of each row's tree (its longest root-to-leaf path; 0 for no nodes)."""
    real = torch.arange(parents.shape[1], device=parents.device)[None] < lengths[:, None]
    return torch.where(real, depths(parents), 0).amax(1) if parents.shape[1] else lengths * 0


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: entry (b, i, j) is True when node j is node i or one of its ancestors."""
    B, N = parents.shape
    anc = torch.eye(N, dtype=torch.bool, device=parents.device)[None].repeat(B, 1, 1)
    for i in range(N):
        p = parents[:, i]
        has = p >= 0
        if bool(has.any()):
            inherited = anc[torch.arange(B, device=parents.device), p.clamp_min(0)]
            anc[:, i] |= inherited & has[:, None]
    return anc


def block_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the verify block [root, node 0, ..., node N-1]: position offsets [B, N+1] (root 0,
    node i its depth) and visibility [B, N+1, N+1] (query t sees block slot s)."""
    B, N = parents.shape
    offsets = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=parents.device), depths(parents)], 1)
    vis = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=parents.device)
    vis[:, :, 0] = True
    vis[:, 1:, 1:] = ancestors(parents)
    return offsets, vis


def path_block_index(path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Block positions [B, max n + 1] of the root and the accepted nodes (padded with the last one):
    where the scores that decided each emitted token sit."""
    width = int(n.max()) if n.numel() else 0
    root = torch.zeros(path.shape[0], 1, dtype=path.dtype, device=path.device)
    steps = torch.cat([root, path[:, :width] + 1], 1)
    last = steps.gather(1, n[:, None])
    pad = torch.arange(width + 1, device=path.device)[None] > n[:, None]
    return torch.where(pad, last, steps)
