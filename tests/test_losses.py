"""The chunked distillation loss through the drafter's LM head equals KL(p ‖ q) computed the plain
way (kl_div over log_softmax), in value and in the gradients of the states and of the head."""
import pytest
import torch
import torch.nn.functional as F

from speculant.trained.losses import head_kl


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_head_kl_matches_kl_div_and_its_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    R, H, Ht, V = 37, 16, 24, 50
    x = torch.randn(R, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    final, rows = torch.randn(R, Ht, generator=g), torch.randn(V, Ht, generator=g)
    w = torch.rand(R, generator=g)
    w[3] = 0.0  # a row that does not count
    got = head_kl(x, weight, final, rows, w, chunk=chunk)
    per_row = F.kl_div((x @ weight.T).log_softmax(-1), (final @ rows.T).log_softmax(-1), log_target=True,
                       reduction="none").sum(-1)
    want = (w * per_row).sum()
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(torch.autograd.grad(3.0 * got, (x, weight)), torch.autograd.grad(3.0 * want, (x, weight))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
