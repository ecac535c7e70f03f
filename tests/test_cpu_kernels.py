"""The CPU fast path's matmul kernels (models/cpu_kernels.py): every choice runs on every machine
(the AVX2 fallback is forced on AVX-512 CPUs too); none changes greedy output."""
import pytest
import torch

import speculant
from speculant.drafters import ModelDrafter, NgramDrafter, NoDrafter
from speculant.errors import SpeculantError
from speculant.models import LoadedModel, cpu_kernels
from speculant.models.cpu_kernels import PackedLinear, onednn_packs
from speculant.models.fast import FastLlama
from helpers import (KERNEL_CHOICES, assert_same_or_bf16_near_tie, hf_greedy, mismatch_report, perturbed,
                     tiny_llama)


def test_the_bf16_probe_says_whether_packing_works():
    """No crash on any CPU: where the probe says no, oneDNN indeed refuses bf16 weights."""
    w = torch.randn(32, 16).to(torch.bfloat16)
    if onednn_packs(torch.bfloat16):
        PackedLinear(w)
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(w, 1)


def test_prepacked_bf16_linear_gives_the_same_bits_as_f_linear():
    if not onednn_packs(torch.bfloat16):
        pytest.skip(f"oneDNN has no bf16 kernels on this CPU ({cpu_kernels.cpu_capability()})")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f, bias in ((96, 64, False), (200, 64, True), (64, 200, False)):
        w = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)
        b = torch.randn(out_f, generator=g).to(torch.bfloat16) if bias else None
        packed = PackedLinear(w, b)
        for m in (1, 3, 9, 16):
            x = torch.randn(2, m, in_f, generator=g).to(torch.bfloat16)
            assert torch.equal(packed(x), torch.nn.functional.linear(x, w, b)), (out_f, in_f, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_packed_linear_equals_f_linear_up_to_rounding(dtype):
    """fp32 packing (any x86-64 CPU) and the exact fp32 upcast of bf16 weights (bf16 blocks on AVX2)."""
    if not onednn_packs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 64, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    packed = PackedLinear(w, b, compute=torch.float32, hint=8)
    for m in (1, 5, 16):
        x = torch.randn(m, 64, generator=g).to(dtype)
        got = packed(x)
        assert got.dtype == dtype
        exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7  # fp32 sums; one bf16 rounding of the result
        torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * 8)


def test_a_wrong_packed_weight_is_caught():
    """The comparison above can fail: a transposed weight does not pass it."""
    if not onednn_packs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    w = torch.randn(64, 64)
    x = torch.randn(3, 64)
    assert not torch.allclose(PackedLinear(w.t().contiguous(), hint=8)(x), torch.nn.functional.linear(x, w), atol=1e-3)


def test_plans_per_dtype(monkeypatch):
    big = 10 ** 6
    assert cpu_kernels.plan(torch.float32, big, "aten").step_pack is None
    if onednn_packs(torch.float32):
        assert cpu_kernels.plan(torch.float32, big).step_pack == torch.float32
        # forced: one-token steps keep HF's own kernel (bit-identical plain decoding), blocks go through fp32
        p = cpu_kernels.plan(torch.bfloat16, big, "fp32-blocks")
        assert (p.step_pack, p.block_pack) == (None, torch.float32), p
        # a CPU without oneDNN bf16 (AVX2) gets that plan by itself
        real = cpu_kernels.onednn_packs
        monkeypatch.setattr(cpu_kernels, "onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))
        auto = cpu_kernels.plan(torch.bfloat16, big)
        assert (auto.step_pack, auto.block_pack) == (None, torch.float32) and "no oneDNN bf16" in auto.name
    monkeypatch.setattr(cpu_kernels, "onednn_packs", lambda dtype: False)  # a torch build without oneDNN
    assert cpu_kernels.plan(torch.float32, big).step_pack is None
    for forced in ("onednn", "fp32-blocks"):
        with pytest.raises(SpeculantError, match="cannot pack"):
            cpu_kernels.plan(torch.bfloat16, big, forced)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "available_bytes", lambda: 3 * big)  # a copy would not fit
    assert cpu_kernels.plan(torch.float32, big).step_pack is None


def test_an_unknown_kernel_choice_is_one_line(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "fastest")
    with pytest.raises(SpeculantError, match="unknown CPU kernel choice 'fastest'"):
        FastLlama(tiny_llama(0))


def _prompts():
    g = torch.Generator().manual_seed(107)
    return [torch.randint(1, 96, (3 + 5 * i,), generator=g).tolist() for i in range(4)]


def _drafter(kind, target):
    return {"none": NoDrafter, "ngram": NgramDrafter}.get(kind, lambda: ModelDrafter(perturbed(target, 0.3, seed=14)))()


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("kind,gamma,batch", [("none", 1, 1), ("ngram", 4, 1), ("model", 3, 1), ("ngram", 8, 1),
                                              ("model", 3, 4)])
def test_float32_greedy_identical_to_hf_with_each_kernel_choice(choice, kind, gamma, batch):
    kernels = None if choice == "auto" else choice
    target = tiny_llama(8)
    prompts = _prompts()[:batch] if batch > 1 else [(_prompts()[1][:4] * 6)]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    gen = speculant.Generator(LoadedModel(target, None, "tiny"), _drafter(kind, target), gamma=gamma, path="fast",
                              kernels=kernels)
    outs = gen.generate_ids(prompts, max_new_tokens=30)
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert outs[0].stats["cpu_kernels"] == gen.backend.fast.kernels
    if choice == "aten":
        assert outs[0].stats["cpu_kernels"].startswith("aten")


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("kind,gamma", [("ngram", 4), ("model", 3), ("ngram", 8)])
def test_bfloat16_speculation_is_plain_decoding_bit_for_bit_with_each_kernel_choice(choice, kind, gamma):
    """With each kernel choice a verify block's rows get one-token steps' bits (tests/test_invariance.py),
    so speculative text is plain decoding's exactly. Plain decoding itself may part from HF's bf16
    forward (SDPA, one oneDNN call for one row) only at a bf16 near-tie: it rounds otherwise there."""
    kernels = None if choice == "auto" else choice
    target = tiny_llama(7).to(torch.bfloat16)
    g = torch.Generator().manual_seed(107)
    prompt = (torch.randint(1, 96, (4,), generator=g).tolist() * 8)[:20]
    ref = hf_greedy(target, prompt, 30)

    def run(drafter):
        gen = speculant.Generator(LoadedModel(target, None, "tiny"), drafter, gamma=gamma, path="fast",
                                  kernels=kernels)
        return gen, gen.generate_ids([prompt], max_new_tokens=30)[0]

    _, plain = run(NoDrafter())
    gen, out = run(_drafter(kind, target))
    assert out.token_ids == plain.token_ids and out.stats["exact"] == "bitwise"
    assert out.stats["draft_tokens"] > 0
    assert_same_or_bf16_near_tie(target, prompt, ref, plain.token_ids)
    if choice == "fp32-blocks":
        assert gen.backend.fast.kernels == "aten steps + onednn-packed fp32 blocks"


def test_stacked_projections_follow_the_bits_check(monkeypatch):
    """q/k/v and gate/up are one packed matmul each where that keeps every part's bits (always in
    float32; in bf16 where this CPU's kernels do), else HF's separate matmuls; speculation stays
    plain decoding's bit for bit either way."""
    if not onednn_packs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    target = tiny_llama(7)
    assert "qkv_packed" in FastLlama(target).pass_set.layers[0]  # float32
    if not onednn_packs(torch.bfloat16):
        return
    bf16 = tiny_llama(7).to(torch.bfloat16)
    exact = cpu_kernels.stacking_is_exact(torch.bfloat16, 64, (64, 32, 32), False, 1)
    layer = FastLlama(bf16).pass_set.layers[0]
    assert ("qkv_packed" in layer) == exact and ("q_packed" in layer) != exact
    monkeypatch.setattr(cpu_kernels, "stacking_is_exact", lambda *a: False)  # a CPU whose kernels differ
    gen = speculant.Generator(LoadedModel(bf16, None, "tiny"), NgramDrafter(), gamma=4, path="fast")
    assert {"q_packed", "k_packed", "v_packed", "gate_packed", "up_packed"} <= set(gen.backend.fast.pass_set.layers[0])
    prompt = [5, 9, 14, 3] * 5
    spec = gen.generate_ids([prompt], max_new_tokens=20)[0]
    assert spec.token_ids == gen.generate_ids([prompt], max_new_tokens=20, speculate=False)[0].token_ids
    assert spec.stats["accepted_draft_tokens"] > 0


def test_the_bits_check_fails_a_stacking_that_rounds_otherwise(monkeypatch):
    if not onednn_packs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    dtype = torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
    check = cpu_kernels.stacking_is_exact.__wrapped__  # uncached
    real = PackedLinear.stacked.__func__

    def off_by_a_step(cls, weights, biases, compute=None, hint=1):  # parts computed otherwise: one weight nudged
        return real(cls, [weights[0] * (1 + 2 ** -6)] + weights[1:], biases, compute, hint)
    monkeypatch.setattr(PackedLinear, "stacked", classmethod(off_by_a_step))
    assert not check(dtype, 64, (64, 32, 32), False, 1)


def test_pack_linears_stacks_a_drafter_layers_projections_and_keeps_its_outputs():
    from speculant.models.cpu_kernels import pack_linears
    from speculant.trained.blocks import Layer, inv_freq, rope

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "model_type": "llama"}
    torch.manual_seed(0)
    layer = Layer(cfg).eval()
    h = torch.randn(1, 5, 64)
    cos_sin = rope(torch.arange(5)[None], inv_freq(cfg), torch.float32)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = layer(h, cos_sin, lambda k, v: (k, v), mask)
        pack_linears(layer)
        got = layer(h, cos_sin, lambda k, v: (k, v), mask)
    if onednn_packs(torch.float32):
        assert layer.self_attn.stacked_qkv is not None and layer.mlp.stacked_gate_up is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
