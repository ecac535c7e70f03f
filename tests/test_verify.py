"""The acceptance math on its own: exact enumeration for small vocabularies, and the greedy rule."""
import itertools

import pytest
import torch

from speculant.verify import (
    acceptance_probability, greedy_verify, next_token_distribution, residual_distribution, sample_verify,
)

V = 4


def _dist(*vals):
    t = torch.tensor(vals, dtype=torch.float64)
    return t / t.sum()


def _random_dist(g, zeros=()):
    d = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
    for z in zeros:
        d[z] = 0
    return d / d.sum()


def test_greedy_accepts_matching_prefix_then_target_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    n, nxt = greedy_verify(target, draft, torch.tensor([3, 3, 1]))
    assert n.tolist() == [3, 1, 1]
    assert nxt.tolist() == [8, 9, 2]  # all accepted -> bonus; row 2: one real draft -> target's next


def _exact_two_token_distribution(p1, p2_given, q1, q2_given, one_hot):
    """P(first two output tokens) of one speculative pass (γ=2) followed by plain decoding,
    enumerating every draft and accept/reject outcome with the library's own functions."""
    out = torch.zeros(V, V, dtype=torch.float64)
    for x1, x2 in itertools.product(range(V), repeat=2):
        if one_hot:  # a deterministic drafter: the draft is fixed, q is one-hot on it
            if (x1, x2) != (0, 2):
                continue
            w, Q1, Q2 = 1.0, torch.nn.functional.one_hot(torch.tensor(x1), V).double(), torch.nn.functional.one_hot(torch.tensor(x2), V).double()
        else:
            Q1, Q2 = q1, q2_given[x1]
            w = float(q1[x1] * Q2[x2])
        if w == 0:
            continue
        p = torch.stack([p1, p2_given[x1], _dist(1, 1, 1, 1)])[None]  # [1, 3, V]; position 3 unused here
        q = torch.stack([Q1, Q2])[None]
        draft = torch.tensor([[x1, x2]])
        a = acceptance_probability(p[0, :2].gather(1, draft.T).squeeze(1), q[0].gather(1, draft.T).squeeze(1))
        for n in range(3):
            prob_n = float(torch.prod(a[:n])) * (float(1 - a[n]) if n < 2 else 1.0)
            if prob_n == 0:
                continue
            # a deterministic drafter reports q as None; the verifier must treat it as one-hot
            final = next_token_distribution(p, None if one_hot else q, draft, torch.tensor([2]), torch.tensor([n]))[0]
            if n == 0:  # y1 from the residual, y2 from the next (plain) pass
                out += w * prob_n * final[:, None] * torch.stack([p2_given[y] for y in range(V)])
            elif n == 1:
                out[x1] += w * prob_n * final
            else:
                out[x1, x2] += w * prob_n
    return out


@pytest.mark.parametrize("case", ["random", "q_zero_where_p_not", "p_zero_where_q_not", "one_hot_q", "q_equals_p"])
@pytest.mark.parametrize("seed", range(4))
def test_speculative_pass_reproduces_target_distribution_exactly(case, seed):
    g = torch.Generator().manual_seed(seed)
    p1 = _random_dist(g)
    p2 = [_random_dist(g) for _ in range(V)]
    q1 = _random_dist(g)
    q2 = [_random_dist(g) for _ in range(V)]
    if case == "q_zero_where_p_not":
        q1 = _random_dist(g, zeros=(1, 3))
        q2 = [_random_dist(g, zeros=(0,)) for _ in range(V)]
    if case == "p_zero_where_q_not":
        p1 = _random_dist(g, zeros=(2,))
        p2 = [_random_dist(g, zeros=(1,)) for _ in range(V)]
    if case == "q_equals_p":
        q1, q2 = p1.clone(), [d.clone() for d in p2]
    got = _exact_two_token_distribution(p1, p2, q1, q2, one_hot=case == "one_hot_q")
    want = p1[:, None] * torch.stack(p2)
    assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()


def test_a_wrong_residual_is_caught_by_the_exact_test(monkeypatch):
    """The enumeration above has power: sampling the correction from p instead of norm(max(0, p-q)) fails it."""
    import speculant.verify as verify

    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p / p.sum(-1, keepdim=True))
    g = torch.Generator().manual_seed(0)
    p1, q1 = _random_dist(g), _random_dist(g)
    p2 = [_random_dist(g) for _ in range(V)]
    q2 = [_random_dist(g) for _ in range(V)]
    got = _exact_two_token_distribution(p1, p2, q1, q2, one_hot=False)
    assert (got - p1[:, None] * torch.stack(p2)).abs().max() > 1e-3


def test_residual_and_acceptance_formulas():
    p, q = _dist(1, 2, 3, 4), _dist(4, 3, 2, 1)
    assert torch.allclose(residual_distribution(p, q), _dist(0, 0, 1, 3))
    assert torch.allclose(residual_distribution(p, p), p)  # nothing left: falls back to p
    assert torch.allclose(acceptance_probability(p, q), torch.tensor([0.25, 2 / 3, 1, 1], dtype=torch.float64))
    assert acceptance_probability(torch.tensor([0.3]), torch.tensor([0.0])).item() == 0


def test_sample_verify_monte_carlo_first_token_matches_p():
    """The batched sampler itself (uniform draws, first rejection, residual, bonus) gives p."""
    g = torch.Generator().manual_seed(0)
    B = 200_000
    p1, q1 = _dist(1, 2, 3, 4), _dist(4, 1, 1, 4)
    p = torch.stack([p1, _dist(1, 1, 1, 1)])[None].expand(B, 2, V).float()
    q = q1[None, None].expand(B, 1, V).float()
    draft = torch.multinomial(q[:, 0], 1, generator=g)
    n, nxt = sample_verify(p, draft, torch.ones(B, dtype=torch.long), q, g)
    first = torch.where(n > 0, draft[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / B
    assert torch.allclose(freq, p1, atol=0.005), freq
    # acceptance rate is sum(min(p, q))
    assert abs(n.double().mean().item() - torch.minimum(p1, q1).sum().item()) < 0.005
