"""A GGUF read straight into the int8 kernels (``dtype="q8"``, models/gguf_model.py, csrc/core/gguf.h).

- Every common GGML block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
  IQ4_XS) repacks exactly: the packed weight's values are the gguf package's own dequantisation, on
  random blocks, on every ISA branch (the repacking is plain C++; csrc/harness compares the
  branches' kernels over every type too, NEON included).
- The int8 linear over each type is width-invariant and equals a float64 reference (the dequantised
  weight against the row's quantized activations) to float32's rounding: a wrong scale, min or half
  block fails it (the integer sums themselves are every branch's alike: csrc/harness); q/k/v of
  different types in one call give the bits of separate calls.
- A tiny model written in each type (and in F32, F16, BF16), llama and qwen2 (with q/k/v biases),
  read directly: its logits are Hugging Face's over the dequantised file within q8's rounding (a
  wrong row order, scale or tensor fails it), no dense float32 linear runs, nothing holds the
  weights' float32 values, and Hugging Face's own forward refuses in one line.
- Speculative output equals plain decoding on a directly read Q4_K_M-like file, with every
  drafter kind that reads no trained weights and with a smaller GGUF as the drafter.
- The default target read directly gives the dequantised q8 path's very tokens.
"""
import numpy as np
import pytest
import torch

import speculant
from speculant.errors import SpeculantError
from speculant.models import gguf_model, quantized
from speculant.models.fast import FastLlama
from speculant.models.loading import load_model
from speculant.models.quantized import Q8_TYPES, PackedQ8, QuantEmbedding, QuantLinear
from helpers import write_tiny_gguf
from test_q8 import q8_kernels, reference_quantize  # noqa: F401 (a fixture)
from test_quantized import needs_kernel

GGML = __import__("gguf").GGMLQuantizationType
# a Q4_K_M file's mix (llama.cpp's: Q6_K for v, down and the output in part of the layers)
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}


def _packed(kind: str, rows: int, cols: int, seed: int = 0, scale_bits: int = 0x2000):
    raw = quantized.random_gguf_blocks(kind, rows, cols, torch.Generator().manual_seed(seed), scale_bits)
    return raw, PackedQ8.of_gguf(kind, GGML[kind].value, raw, cols)


@needs_kernel
@pytest.mark.parametrize("kind", Q8_TYPES)
def test_every_type_repacks_to_the_files_own_values(q8_kernels, kind):
    from gguf import quants

    for rows, cols in ((37, 256), (16, 512), (5, 1024)):
        raw, w = _packed(kind, rows, cols, seed=rows)
        want = quants.dequantize(raw, GGML[kind]).reshape(rows, cols)
        got = w.dequantize().numpy()
        # equal values (a zero's sign may differ: Q4_0's (q - 8) d against q d + (-8 d))
        assert np.array_equal(got, want), f"{kind} {rows}x{cols}: {np.argwhere(got != want)[:3].tolist()}"
        picked = torch.tensor([rows - 1, 0, rows // 2])
        assert torch.equal(w.dequantize(picked), torch.from_numpy(want)[picked])


def _reference(x: torch.Tensor, w: PackedQ8, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernels' arithmetic in float64: the weights' values against each row's quantized
    activations (d * q a block), and the sum of the terms' sizes (float32's rounding is a few units
    of 2^-24 of it)."""
    q, d, _ = reference_quantize(x.numpy())
    xq = torch.from_numpy(q).double() * torch.from_numpy(d).double().repeat_interleave(32, 1)
    weight = w.dequantize().double()
    return xq @ weight.T + bias.double(), xq.abs() @ weight.abs().T + bias.double().abs()


@needs_kernel
@pytest.mark.parametrize("kind", Q8_TYPES)
def test_int8_linear_over_every_type_is_width_invariant_and_the_reference(q8_kernels, kind):
    _, w = _packed(kind, 53, 512, seed=1, scale_bits=0x3800)  # scales up to 2^-1
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(53, generator=g)
    lin = QuantLinear(w, bias)
    x = torch.randn(40, 512, generator=g) * 2
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    for m in list(range(2, 18)) + [31, 40]:
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
    want, size = _reference(x, w, bias)
    assert bool(((alone.double() - want).abs() <= 1e-6 * size).all())  # 16 blocks' roundings: < 2e-7 of it


@needs_kernel
def test_weights_of_different_types_side_by_side_give_separate_calls_bits(q8_kernels):
    parts = [_packed("Q4_K", 64, 512, seed=3)[1], _packed("Q4_K", 32, 512, seed=4)[1], _packed("Q6_K", 21, 512, seed=5)[1]]
    stacked = PackedQ8.stacked(parts)
    assert stacked.kinds == [41, 62] and stacked.outs == [96, 21]  # the two Q4_K joined: one part
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    one = QuantLinear(stacked, torch.zeros(117))
    for m in (1, 4, 9):
        assert torch.equal(one(x[:m]), torch.cat([QuantLinear(p, torch.zeros(p.shape[0]))(x[:m]) for p in parts], 1))
    with pytest.raises(ValueError):
        PackedQ8.stacked([_packed("Q6_K", 21, 512)[1], _packed("Q4_K", 32, 512)[1]])  # 21 outputs: not whole groups


def _logits(fast: FastLlama, tokens: torch.Tensor) -> torch.Tensor:
    keys, values = fast.new_cache(1, 128)
    return fast.prefill(tokens, keys, values)


TEXT = "The quick brown fox jumps over the lazy dog; then it sleeps."


@needs_kernel
@pytest.mark.parametrize("types,arch", [(t, "llama") for t in Q8_TYPES + ("F32", "F16", "BF16")]
                         + [(Q4_K_M, "llama"), (Q4_K_M, "qwen2"), ("Q5_0", "qwen2")],
                         ids=lambda v: v if isinstance(v, str) else "Q4_K_M")
def test_a_tiny_gguf_read_directly_is_hf_within_q8s_rounding(tmp_path, types, arch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", types, arch=arch, bias=arch == "qwen2", tied=types == "Q8_0")
    direct = load_model(str(path), device="cpu", dtype="q8")
    dense = load_model(str(path), device="cpu", dtype="float32")  # transformers' own dequantisation
    assert gguf_model.is_direct(direct.model) and isinstance(direct.model.model.embed_tokens, QuantEmbedding) == (
        types not in ("F32", "F16", "BF16"))
    for module in direct.model.modules():  # the linears' weights hold one float, not their values
        if isinstance(module, torch.nn.Linear):
            assert module.weight.untyped_storage().nbytes() <= 4
    tokens = torch.tensor([direct.tokenizer(TEXT)["input_ids"]])
    assert tokens.tolist() == [dense.tokenizer(TEXT)["input_ids"]]
    fast = FastLlama(direct.model)
    assert "dense" not in fast.kernels, fast.kernels  # every linear on the kernels
    got, want = _logits(fast, tokens), dense.model(tokens).logits
    error = ((got - want).norm() / want.norm()).item()
    assert error < 0.08, error  # q8's activation rounding: ~2-4 %; a wrong row order or scale: tens of %
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8
    with pytest.raises(SpeculantError, match="fast path only"):
        direct.model(tokens)


@needs_kernel
def test_the_row_order_check_can_fail(tmp_path, monkeypatch):
    """Without undoing llama.cpp's q/k row interleave, the comparison above fails."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q4_K_M, arch="llama")
    monkeypatch.setattr(gguf_model, "_head_order", lambda rows, heads: np.arange(rows))
    direct = load_model(str(path), device="cpu", dtype="q8")
    dense = load_model(str(path), device="cpu", dtype="float32")
    tokens = torch.tensor([direct.tokenizer(TEXT)["input_ids"]])
    got, want = _logits(FastLlama(direct.model), tokens), dense.model(tokens).logits
    assert ((got - want).norm() / want.norm()).item() > 0.08


@needs_kernel
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model", "model+ngram"])
def test_speculative_equals_plain_on_a_gguf_read_directly(tmp_path, drafter):
    target = write_tiny_gguf(tmp_path / "target.gguf", Q4_K_M, arch="qwen2", bias=True, layers=3)
    small = write_tiny_gguf(tmp_path / "small.gguf", "Q5_0", arch="qwen2", bias=True, layers=1, seed=1)
    spec = drafter.replace("model", f"model:{small}")
    prompts = ["abc abc abc abc", "Hello, hello, hello, world", "1 2 3 4 1 2 3 4 1 2"]
    plain = speculant.load(str(target), drafter="none", dtype="q8", device="cpu")
    want = [plain.generate(p, max_new_tokens=24, temperature=0.0).token_ids for p in prompts]
    gen = speculant.load(str(target), drafter=spec, dtype="q8", device="cpu")
    for gamma in (1, 4, "auto"):
        alone = [gen.generate(p, max_new_tokens=24, temperature=0.0, gamma=gamma).token_ids for p in prompts]
        assert alone == want, gamma
        batched = [o.token_ids for o in gen.generate(prompts, max_new_tokens=24, temperature=0.0, gamma=gamma)]
        assert batched == want, gamma


@needs_kernel
def test_a_type_the_kernels_do_not_take_is_one_line(tmp_path):
    odd = write_tiny_gguf(tmp_path / "iq2.gguf", {"attn_q": "IQ2_XXS"})
    with pytest.raises(SpeculantError) as e:
        load_model(str(odd), device="cpu", dtype="q8")
    said = str(e.value)
    assert "\n" not in said and "blk.0.attn_q.weight" in said and "IQ2_XXS" in said, said


@pytest.mark.slow
@needs_kernel
def test_the_default_target_read_directly_gives_the_dequantised_q8_tokens():
    from speculant.models import loading

    prompts = ["Write a haiku about rivers", "Explain what a hash map is.", "List three primes."]
    direct = speculant.load("default", drafter="none", dtype="q8", device="cpu")
    assert gguf_model.is_direct(direct.target.model)
    got = [direct.generate(p, max_new_tokens=32, temperature=0.0).token_ids for p in prompts]
    dense = load_model("default", device="cpu", dtype="float32")
    loading._attach_quantized(dense.model, loading.resolve_model_path("default"), int8=True)  # the old q8
    try:
        old = speculant.api.Generator(dense, speculant.drafters.make_drafter("none", dense))
        want = [old.generate(p, max_new_tokens=32, temperature=0.0).token_ids for p in prompts]
    finally:
        del dense.model.speculant_quantized, dense.model.speculant_int8
    assert got == want


@needs_kernel
def test_a_draft_models_lm_head_is_rounded_to_the_drafters_bits(tmp_path):
    """A GGUF loaded as a draft model (beside a q8 target) keeps its Q8_0 LM head at
    quantized.DRAFT_BITS bits (its biggest weight, read every draft); as a target, the file's own."""
    path = write_tiny_gguf(tmp_path / "small.gguf", "Q8_0", arch="qwen2", bias=True, layers=1)
    as_target = load_model(str(path), device="cpu", dtype="q8").model.speculant_quantized["lm_head"]
    as_draft = load_model(str(path), device="cpu", dtype="q8", draft=True).model.speculant_quantized["lm_head"]
    assert as_target.kinds == [8] and as_draft.kinds == [4] and as_draft.nbytes < 0.7 * as_target.nbytes
    # the rounding is the drafters' own: within a 4-bit step of the file's values
    want, got = as_target.dequantize(), as_draft.dequantize()
    assert (got - want).abs().max() < (want.abs().max() / 7)
