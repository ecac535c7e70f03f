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


def test_head_kl_under_bf16_autocast_matches_the_float32_loss():
    """Under CPU autocast the matmuls run in bf16 (the loss and gradients keep their dtypes)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    final, rows, w = torch.randn(20, 8, generator=g), torch.randn(40, 8, generator=g), torch.rand(20, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        got = head_kl(x, weight, final, rows, w, chunk=7)
    want = head_kl(x, weight, final, rows, w)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=0.05)
    gx, gw = torch.autograd.grad(got, (x, weight))
    assert gx.dtype == gw.dtype == torch.float32
    wx, ww = torch.autograd.grad(want, (x, weight))
    assert torch.allclose(gx, wx, atol=0.05 * float(wx.abs().max()))
    assert torch.allclose(gw, ww, atol=0.05 * float(ww.abs().max()))


@pytest.mark.parametrize("native", [True, False])
def test_training_autocasts_to_bf16_only_where_features_are_bf16(monkeypatch, native):
    """A CPU without native bf16 matmuls (AVX2) trains in float32; one with them (AVX512-BF16/AMX)
    under bf16 autocast; an explicit --dtype float32 never autocasts."""
    from speculant.tools.train import mixed_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
    x = torch.randn(2, 4)
    with mixed_precision("cpu"):
        assert (x @ x.T).dtype == (torch.bfloat16 if native else torch.float32)
    with mixed_precision("cpu", "float32"):
        assert (x @ x.T).dtype == torch.float32


def test_head_kl_without_gradients_gives_the_same_loss():
    """Under no_grad (a held-out loss) only the forward runs: the same value, nothing to backpropagate."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    final, rows, w = torch.randn(20, 8, generator=g), torch.randn(40, 8, generator=g), torch.rand(20, generator=g)
    want = head_kl(x, weight, final, rows, w, chunk=7)
    with torch.no_grad():
        got = head_kl(x, weight, final, rows, w, chunk=7)
    assert not got.requires_grad and float(got) == pytest.approx(float(want), rel=1e-6)
    frozen = head_kl(x.detach(), weight.detach(), final, rows, w, chunk=7)
    assert not frozen.requires_grad and float(frozen) == pytest.approx(float(want), rel=1e-6)
