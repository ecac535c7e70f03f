"""Pure acceptance math: which draft tokens the target keeps, and the token it adds.

Batched tensor functions of the processed target distribution p, the draft tokens and the draft
distribution q. They know nothing of models, caches or drafters.

Shapes: B rows, G = γ draft slots, V vocabulary. ``draft_len[b] <= G`` is how many of row b's
draft slots are real (a drafter may propose fewer, e.g. n-gram lookup with no match).
"""
from __future__ import annotations

from typing import Callable

import torch

from .sampling import argmax


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row of a [B, G] bool tensor."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _real_slots(draft_len: torch.Tensor, G: int) -> torch.Tensor:
    return torch.arange(G, device=draft_len.device)[None, :] < draft_len[:, None]


def greedy_verify(target_choice: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor):
    """Greedy: accept while the draft equals the target's argmax.

    target_choice: [B, G+1] argmax of the processed target scores at each block position.
    Returns (n_accepted [B], next_token [B]): the output of this pass is draft[:n] + [next_token].
    """
    G = draft.shape[1]
    if G == 0:  # a plain pass: the target's own token (saves a plain step's few tensor ops)
        return torch.zeros_like(draft_len), target_choice[:, 0]
    accept = (draft == target_choice[:, :G]) & _real_slots(draft_len, G)
    n = _first_rejection(accept)
    return n, target_choice.gather(1, n[:, None]).squeeze(1)


_NO_PARENTS = torch.empty(0, dtype=torch.long)  # a chain's "parents" for the CPU kernel (read only)
_compiled_greedy_accept: Callable | None = None  # the CPU kernels' (models/native.py sets it where built)


def use_compiled_greedy_accept(fn) -> None:
    """``fn(scores, tokens, parents or an empty tensor for chains, lengths)`` -> (n, next, path) as
    ``greedy_accept`` gives them, for float32 scores on a CPU."""
    global _compiled_greedy_accept
    _compiled_greedy_accept = _compiled_greedy_accept or fn


def greedy_accept(scores: torch.Tensor, draft: torch.Tensor, parents: torch.Tensor | None, draft_len: torch.Tensor):
    """Greedy acceptance from the processed target scores [B, G+1, V]: their argmax at each block
    position, then ``greedy_verify`` (parents None) or ``tree_greedy_verify``. Returns (n [B], next
    [B], the tree's path [B, G] or None). On a CPU in one kernel call where this process has the
    kernels: after a pass has streamed the weights through the caches every small op of a walk runs
    cold, and in situ the call took 0.11-0.14 ms an EAGLE γ 2 pass where the argmax and the walk's
    tensor ops took 0.24-0.30 (a 2-core Zen 4)."""
    fn = _compiled_greedy_accept
    if (fn is not None and scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 3
            and scores.shape[-1] > 0 and draft.dtype == draft_len.dtype == torch.long):
        n, nxt, path = fn(scores.contiguous(), draft.contiguous(),
                          _NO_PARENTS if parents is None else parents.to(torch.long).contiguous(), draft_len.contiguous())
        return n, nxt, None if parents is None else path
    choice = argmax(scores)
    if parents is None:
        return (*greedy_verify(choice, draft, draft_len), None)
    return tree_greedy_verify(choice, draft, parents, draft_len)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for the drafted tokens x. A zero q(x) (impossible draft) is never accepted."""
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-38), torch.zeros_like(p_draft))
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension; falls back to p where p == q (no mass left)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-38), p)


def one_hot_probs(draft: torch.Tensor, vocab: int, dtype=torch.float32) -> torch.Tensor:
    """q of a deterministic drafter (n-gram lookup): all mass on the proposed token."""
    return torch.nn.functional.one_hot(draft, vocab).to(dtype)


def next_token_distribution(p, q, draft, draft_len, n):
    """The distribution the pass's last token is drawn from, given n accepted drafts per row:
    norm(max(0, p_n - q_n)) after a rejection, p_n (the bonus) when every real draft was accepted.
    q None = one-hot on the draft tokens."""
    B = p.shape[0]
    rows = torch.arange(B, device=p.device)
    p_n = p[rows, n]
    rejected = (n < draft_len).nonzero().squeeze(1)
    q_n = torch.zeros_like(p_n)
    if rejected.numel():
        if q is None:  # one-hot q: all its mass sits on the rejected token
            q_n[rejected, draft[rejected, n[rejected]]] = 1.0
        else:
            q_n[rejected] = q[rejected, n[rejected]].to(p_n.dtype)
    return residual_distribution(p_n, q_n)


def sample_verify(
    p: torch.Tensor,
    draft: torch.Tensor,
    draft_len: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p: [B, G+1, V] processed target probabilities at each block position.
    q: [B, G, V] processed draft probabilities the drafts were sampled from; None = one-hot.
    Accept x_j with probability min(1, p(x_j)/q(x_j)); at the first rejection sample from
    norm(max(0, p - q)); if every real draft is accepted, sample a bonus token from p.
    Returns (n_accepted [B], next_token [B]).
    """
    B, G1, V = p.shape
    G = G1 - 1
    p_x = p[:, :G].gather(2, draft[..., None]).squeeze(2)
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, draft[..., None]).squeeze(2).to(p_x.dtype)
    u = torch.rand(B, G, device=p.device, generator=generator, dtype=p.dtype)
    accept = (u < acceptance_probability(p_x, q_x)) & _real_slots(draft_len, G)
    n = _first_rejection(accept)
    final = next_token_distribution(p, q, draft, draft_len, n)
    next_token = torch.multinomial(final, 1, generator=generator).squeeze(1)
    return n, next_token


# ---- token trees -------------------------------------------------------------------------------
# A tree proposal: node i of row b carries tokens[b, i] and hangs under parents[b, i] (an earlier
# node, or -1 for the root: the pass's first, already-decided token). Nodes at i >= length[b] are
# padding. Block position 0 is the root, block position i + 1 is node i, so the target's scores at
# block position i + 1 judge node i's children. A chain is the tree with parents = i - 1.


def chain_parents(batch: int, width: int, device=None) -> torch.Tensor:
    return (torch.arange(width, device=device) - 1)[None].expand(batch, width)


def _children(parents, real, node, alive):
    """[B, N] bool: the real children of each row's current ``node`` (-1 = the root)."""
    return (parents == node[:, None]) & real & alive[:, None]


def tree_greedy_verify(target_choice: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       lengths: torch.Tensor):
    """Greedy on a tree: from the root, follow the child carrying the target's argmax while one exists.

    target_choice: [B, N+1] argmax of the processed target scores at each block position.
    Returns (n_accepted [B], next_token [B], path [B, N]: the accepted nodes in order, -1 after).
    (A walk of a few nodes a row, in Python lists: a loop of tensor ops a depth cost ~35 us a depth.)"""
    B, N = tokens.shape
    paths, counts, nexts = [], [], []
    for choice, toks, pars, n in zip(target_choice.tolist(), tokens.tolist(), parents.tolist(), lengths.tolist()):
        node, path = -1, []
        for _ in range(N):  # at most N deep (a malformed tree's cycle ends too)
            want = choice[node + 1]
            child = next((c for c in range(n) if pars[c] == node and toks[c] == want), None)  # the first such child
            if child is None:
                break
            node = child
            path.append(child)
        paths.append(path + [-1] * (N - len(path)))
        counts.append(len(path))
        nexts.append(choice[node + 1])
    dev = tokens.device
    path = torch.tensor(paths, dtype=torch.long, device=dev).view(B, N)
    return (torch.tensor(counts, dtype=torch.long, device=dev), torch.tensor(nexts, dtype=target_choice.dtype, device=dev),
            path)


def sibling_step(r: torch.Tensor, x: torch.Tensor, q: torch.Tensor):
    """One candidate judged against the current target distribution r [B, V]: candidate x [B] was
    drawn from q [B, V] (given the siblings judged before it). Returns (accept probability [B],
    the distribution the output follows if x is rejected: norm(max(0, r - q)) [B, V])."""
    r_x, q_x = r.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1).to(r.dtype)
    return acceptance_probability(r_x, q_x), residual_distribution(r, q.to(r.dtype))


def tree_sample_verify(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, lengths: torch.Tensor,
                       q: torch.Tensor | None, generator: torch.Generator | None = None):
    """Speculative sampling on a tree (SpecInfer's multi-step speculative sampling, Miao et al. 2024;
    with per-candidate q it is also recursive rejection sampling, Jeon et al. 2024).

    At the current node the target distribution is r = p(node). Its children are judged in index
    order: child x (drawn from q(x's node), the distribution it was sampled from given the siblings
    before it: the same q for i.i.d. siblings, q renormalised without earlier siblings when drawn
    without replacement, one-hot for a deterministic drafter) is accepted with probability
    min(1, r(x)/q(x)); on acceptance the walk moves into x, otherwise r becomes norm(max(0, r - q))
    and the next sibling is judged. When no child is accepted the pass ends with a token drawn
    from r (p itself at a leaf: the bonus token). Each step leaves the output distributed as r, so
    the emitted text follows the target exactly, whatever the tree.

    p: [B, N+1, V] processed target probabilities per block position; q: [B, N, V] or None (one-hot).
    Returns (n_accepted [B], next_token [B], path [B, N])."""
    B, N1, V = p.shape
    N = N1 - 1
    dev = p.device
    real = _real_slots(lengths, N)
    rows = torch.arange(B, device=dev)
    node = torch.full((B,), -1, dtype=torch.long, device=dev)
    path = torch.full((B, N), -1, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still walking down (not ended yet)
    r = p[:, 0]
    for depth in range(N):
        kids = _children(parents, real, node, alive)
        if not bool(kids.any()):
            break
        chosen = torch.full((B,), -1, dtype=torch.long, device=dev)
        # judge siblings in index order: the k-th child of each row at step k
        order = torch.where(kids, torch.arange(N, device=dev)[None], N).sort(1).values
        for k in range(int(kids.sum(1).max())):
            cand = order[:, k]
            judged = (cand < N) & (chosen < 0)
            if not bool(judged.any()):
                break
            c = cand.clamp(max=N - 1)
            x = tokens[rows, c]
            qk = torch.nn.functional.one_hot(x, V).to(r.dtype) if q is None else q[rows, c]
            accept_p, rejected_r = sibling_step(r, x, qk)
            u = torch.rand(B, device=dev, generator=generator, dtype=r.dtype)
            accept = judged & (u < accept_p)
            chosen = torch.where(accept, c, chosen)
            r = torch.where((judged & ~accept)[:, None], rejected_r, r)
        moved = chosen >= 0
        path[:, depth] = torch.where(moved, chosen, path[:, depth])
        node = torch.where(moved, chosen, node)
        r = torch.where(moved[:, None], p[rows, node + 1], r)
        alive = moved
    n = (path >= 0).sum(1)
    return n, torch.multinomial(r, 1, generator=generator).squeeze(1), path
