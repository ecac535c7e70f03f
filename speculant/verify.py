"""Pure acceptance math: which draft tokens the target keeps, and the token it adds.

Batched tensor functions of the processed target distribution p, the draft tokens and the draft
distribution q. They know nothing of models, caches or drafters.

Shapes: B rows, G = γ draft slots, V vocabulary. ``draft_len[b] <= G`` is how many of row b's
draft slots are real (a drafter may propose fewer, e.g. n-gram lookup with no match).
"""
from __future__ import annotations

import torch


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
    accept = (draft == target_choice[:, :G]) & _real_slots(draft_len, G)
    n = _first_rejection(accept)
    return n, target_choice.gather(1, n[:, None]).squeeze(1)


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
