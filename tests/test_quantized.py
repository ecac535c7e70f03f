"""Quantized weights on the CPU fast path (``dtype="quantized"``, models/quantized.py).

- Each GGUF format maps onto the kernel's layout exactly: our dequantised weights equal gguf-py's
  own dequantisation bit for bit, on random blocks of every format.
- The kernels (linear, the layer glue, the norm) are width-invariant: a row gets the same bits in a
  call of any width, beside any other rows, and are right (close to float64 references).
- End to end, a tiny Llama whose weights are quantized and the real default target's own Q4_1
  GGUF: speculative output equals plain decoding over the same quantized weights for every
  drafter, and plain decoding agrees with HF ``generate`` on the dequantised model but for
  near-ties (shown with their logit gap).
"""
import functools
import platform

import numpy as np
import pytest
import torch

import speculant
from speculant.drafters import default_drafter, make_drafter, shipped_drafter
from speculant.errors import SpeculantError
from speculant.models import cpu_kernels, quantized
from speculant.models.loading import LoadedModel, load_model
from speculant.models.quantized import DenseWeight, QuantLinear, QuantWeight
from helpers import hf_greedy, mismatch_report, save_tiny_folder, tiny_llama
from test_invariance import KINDS, _drafter as invariance_drafter, _prompts as invariance_prompts

# the kinds of issue 40 (MTP and speculators' others) read the target's hidden states as eagle, dflash and
# medusa do, which this test covers over quantized weights; their exactness is test_invariance's (CI time)
EVERY_DRAFTER = [k for k in KINDS if k not in ("mtp", "peagle", "dflash2", "dspark", "xpress")]

needs_kernel = pytest.mark.skipif(quantized.kernels() is None, reason="no C++ compiler for the CPU kernels")
# the kernel's ISA branches, each built on any x86 CPU: AVX-512 where the CPU has it (-march=native),
# AVX2 (-mno-avx512f) and plain vector code (-mno-avx2 too), so no branch passes only on this CPU
ISA = {"native": (), "avx2": ("-mno-avx512f",), "generic": ("-mno-avx512f", "-mno-avx2")}


@pytest.fixture(params=sorted(ISA))
def isa_kernels(request, monkeypatch):
    if request.param != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ISA flags for x86 only")
    module = quantized.build(ISA[request.param])
    if module is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    monkeypatch.setattr(quantized, "kernels", lambda: module)
    return module
GGML = __import__("gguf").GGMLQuantizationType
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks of ``kind`` with random codes and random but finite fp16 scales."""
    rng = np.random.default_rng(seed)
    per, size = BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    halves = 2 if kind in ("Q4_1", "Q4_K") else 1
    scales = (rng.standard_normal((rows, cols // per, halves)) * 0.02).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, cols // per, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_gguf_formats_map_exactly(kind):
    import gguf

    raw = _random_blocks(kind, 12, 512)
    want = gguf.quants.dequantize(raw, getattr(GGML, kind)).astype(np.float32)
    got = quantized.from_gguf_blocks(kind, raw, 512).dequantize()
    assert torch.equal(got, torch.from_numpy(want))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features,in_features,bias", [(96, 64, False), (150, 544, True), (13, 32, False)])
def test_linear_kernel_width_invariant_and_right(isa_kernels, bits, out_features, in_features, bias):
    g = torch.Generator().manual_seed(bits)
    w = QuantWeight.quantize(torch.randn(out_features, in_features, generator=g), bits)
    b = torch.randn(out_features, generator=g) if bias else None
    lin = QuantLinear(w, b)
    x = torch.randn(70, in_features, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    for m in list(range(1, 18)) + [31, 32, 33, 64, 70]:
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
        assert torch.equal(lin(x[len(x) - m :]), alone[len(x) - m :]), f"the last {m} rows"
    want = x.double() @ w.dequantize().double().T + (0 if b is None else b.double())
    torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_every_isa_branch_gives_the_same_bits(monkeypatch, bits):
    """The AVX-512 branch (a 4-bit block dequantized by a lookup), the AVX2 one and plain vector code
    compute each row by the same operations in the same order: the same bits, so the lookup is the
    dequantised weights' very values and a machine's ISA does not change a text."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ISA flags for x86 only")
    g = torch.Generator().manual_seed(11)
    w = QuantWeight.quantize(torch.randn(150, 544, generator=g), bits)
    x = torch.randn(9, 544, generator=g)
    outs = {}
    for name, flags in ISA.items():
        module = quantized.build(flags)
        if module is None:
            pytest.skip("no C++ compiler for the CPU kernels")
        monkeypatch.setattr(quantized, "kernels", lambda: module)
        outs[name] = QuantLinear(w)(x)
    assert all(torch.equal(out, outs["native"]) for out in outs.values()), {n: float((o - outs["native"]).abs().max())
                                                                         for n, o in outs.items()}


@needs_kernel
@pytest.mark.parametrize("out_features,in_features,bias", [(96, 64, False), (150, 544, True), (13, 32, False)])
def test_float32_weights_on_the_kernels_give_their_blocks_bits(isa_kernels, out_features, in_features, bias):
    """A float32 weight as a model holds it (``DenseWeight``, bits 32) is multiplied in the order of a
    block's dequantised weights: a dequantised model gets its blocks' very bits, at every width."""
    g = torch.Generator().manual_seed(in_features)
    # float16 scales and mins (as a GGUF's): code * scale is exact, so the dequantised weight is the
    # kernel's fma(code, scale, min) too
    w = QuantWeight.quantize(torch.randn(out_features, in_features, generator=g), 4, halves=True)
    b = torch.randn(out_features, generator=g) if bias else None
    dense, blocks = QuantLinear(DenseWeight(w.dequantize()), b), QuantLinear(w, b)
    x = torch.randn(40, in_features, generator=g)
    alone = torch.cat([dense(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, blocks(x))
    for m in list(range(1, 18)) + [33, 40]:
        assert torch.equal(dense(x[len(x) - m :]), alone[len(x) - m :]), f"the last {m} rows"
    free = torch.randn(out_features, in_features, generator=g)  # any float32 weight, not only a block's
    torch.testing.assert_close(QuantLinear(DenseWeight(free))(x).double(), x.double() @ free.double().T,
                               rtol=1e-5, atol=1e-4)
    # kept in bfloat16 (a bf16 checkpoint's values): the bits of those values in float32, at every width
    halves = QuantLinear(DenseWeight.bfloat16_of(free), b)
    assert torch.equal(halves.weight.dequantize(), free.bfloat16().float())
    assert torch.equal(halves(x), QuantLinear(DenseWeight(free.bfloat16().float()), b)(x))
    for m in (1, 2, 5, 9):
        assert torch.equal(halves(x[:m]), halves(x)[:m]), f"{m} rows, bfloat16"


@needs_kernel
def test_layer_kernels_width_invariant_and_right(isa_kernels):
    """layer_start (norm, q/k/v, rotary), layer_end (o, residual, norm, gate/up, SiLU, down, residual)
    and the final norm against the same math in float64, and each row alone against any width."""
    k = isa_kernels
    g = torch.Generator().manual_seed(0)
    H, heads, kv, D, inter, eps = 64, 4, 2, 16, 128, 1e-5
    lin = {n: QuantLinear(QuantWeight.quantize(torch.randn(o, i, generator=g) * 0.2, bits))
           for n, o, i, bits in (("qkv", (heads + 2 * kv) * D, H, 4), ("o", H, heads * D, 8),
                                 ("gu", 2 * inter, H, 4), ("down", H, inter, 4))}
    ln1, ln2 = 1 + 0.1 * torch.randn(H, generator=g), 1 + 0.1 * torch.randn(H, generator=g)
    M = 19
    h, attn = torch.randn(M, H, generator=g), torch.randn(M, heads * D, generator=g)
    ang = torch.rand(M, D // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()

    def start(r):
        return k.layer_start(h[r], ln1, eps, lin["qkv"].args, 4, cos[r], sin[r], heads + kv, D)

    def end(r):
        return k.layer_end(h[r], attn[r], lin["o"].args, 8, ln2, eps, lin["gu"].args, 4, lin["down"].args, 4)

    for fn in (start, end, lambda r: k.norm(h[r], ln1, eps)):
        alone = torch.cat([fn(slice(i, i + 1)) for i in range(M)])
        for m in (2, 3, 4, 5, 8, 19):
            assert torch.equal(fn(slice(0, m)), alone[:m])

    def norm(x, w):
        x = x.double()
        return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def mm(x, n):
        return x @ lin[n].weight.dequantize().double().T

    y = mm(norm(h, ln1), "qkv").view(M, -1, D)
    c, s = cos.double()[:, None], sin.double()[:, None]
    roped = y[:, : heads + kv]
    y[:, : heads + kv] = roped * c + torch.cat([-roped[..., D // 2 :], roped[..., : D // 2]], -1) * s
    torch.testing.assert_close(start(slice(None)).double(), y.view(M, -1), rtol=1e-4, atol=1e-4)
    h1 = h.double() + mm(attn.double(), "o")
    gate, up = mm(norm(h1, ln2), "gu").chunk(2, -1)
    want = h1 + mm(torch.nn.functional.silu(gate) * up, "down")
    torch.testing.assert_close(end(slice(None)).double(), want, rtol=1e-4, atol=1e-4)


def _quantized_tiny(seed: int = 0, halves: bool = False):
    """A tiny Llama whose linears are quantized (4-bit, the LM head 8-bit) and whose dense weights
    are the dequantised ones: HF generate on it is the reference for the quantized path. ``halves``:
    float16 scales and mins, as a GGUF's (the dense weights then the kernels' very values)."""
    model = tiny_llama(seed=seed, vocab=96, layers=4, hidden=64)
    weights = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                w = QuantWeight.quantize(mod.weight, 8 if name == "lm_head" else 4, halves=halves)
                mod.weight.copy_(w.dequantize())
                weights[name] = w
    model.speculant_quantized = weights
    return model


@functools.cache
def _tiny_plain() -> list[list[int]]:
    return [speculant.generate(_quantized_tiny(), [p], drafter="none", max_new_tokens=32)[0].token_ids
            for p in invariance_prompts(4)]


def _drafter_for(kind, target, tmp_path):
    drafter = invariance_drafter(kind, target, tmp_path)
    if kind in ("model", "model+ngram"):  # the perturbed copy would keep the target's quantized weights: its own dense ones
        del (drafter if kind == "model" else drafter.model).model.speculant_quantized
    return drafter


@needs_kernel
@pytest.mark.parametrize("kind", EVERY_DRAFTER)
def test_tiny_quantized_speculative_equals_plain_with_every_drafter(tmp_path, kind):
    """Every drafter, γ 1, 4 and auto, alone and in a batch of 4: the text of plain decoding over the
    same quantized weights, and the stats say the path is quantized and proven bitwise."""
    target = _quantized_tiny()
    plain = _tiny_plain()
    drafted = accepted = 0
    for gamma in (1, 4, "auto"):
        for batch in (1, 4):
            outs = speculant.generate(target, invariance_prompts(batch), drafter=_drafter_for(kind, target, tmp_path),
                                      gamma=gamma, max_new_tokens=32)
            for i, out in enumerate(outs):
                assert out.token_ids == plain[i], f"{kind} gamma={gamma} batch={batch} row {i}"
                assert out.stats["exact"] == "bitwise" and out.stats["cpu_kernels"].startswith("quantized")
            drafted += sum(o.stats["draft_tokens"] for o in outs)
            accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
    assert drafted > 0, "nothing was drafted: no verify block was wider than one token"
    if kind != "dflash":  # a random DFlash block is (rightly) rejected: its blocks are verified all the same
        assert accepted > 0, "no draft was ever accepted"


@needs_kernel
def test_tiny_quantized_plain_agrees_with_hf_on_dequantised_weights():
    """Plain decoding over quantized weights vs HF generate over the same weights dequantised: the
    kernels sum in another order, so a near-tie may flip; anything else is a bug (shown with gaps)."""
    model = _quantized_tiny(seed=3)
    target = LoadedModel(model, None, "tiny-quantized")
    plain = speculant.Generator(target, make_drafter("none", target))
    g = torch.Generator().manual_seed(2)
    agree = 0
    for n in (4, 11, 23, 30):
        prompt = torch.randint(0, 96, (n,), generator=g).tolist()
        ref = hf_greedy(model, prompt, 24)
        got = plain.generate_ids([prompt], max_new_tokens=24)[0].token_ids
        if got == ref:
            agree += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].double()
        gap = float(logits[ref[i]] - logits[got[i]])
        assert gap < 1e-3, mismatch_report(model, prompt, ref, got)
    assert agree >= 3


def _last_step_logits(fast, prompt: list[int]) -> torch.Tensor:
    """A prompt's last token as a one-token step after the rest's prefill: its logits."""
    ids, n = torch.tensor([prompt]), len(prompt)
    keys, values = fast.new_cache(1, 64)
    fast.prefill(ids[:, :-1], keys, values)
    return fast.forward(ids[:, -1:], torch.tensor([[n - 1]]), torch.tensor([[n - 1]]), keys, values)


@needs_kernel
def test_a_float32_model_runs_on_the_kernels_with_its_blocks_bits():
    """A float32 model on the CPU runs every pass on the kernel core over its own weights: over the
    dequantised weights of a quantized model, plain and speculative decoding give the quantized
    path's tokens and logits bit for bit. The model's q/k/v and gate/up become views of one stacked
    weight each (no second copy), their values and HF's own forward unchanged; ``kernels="onednn"``
    still asks for oneDNN's packed copies."""
    blocks = _quantized_tiny(seed=5, halves=True)
    model = _quantized_tiny(seed=5, halves=True)
    del model.speculant_quantized
    prompt = invariance_prompts(1)[0]
    with torch.no_grad():
        before = model(torch.tensor([prompt])).logits
    q_before = model.model.layers[1].self_attn.q_proj.weight.clone()
    gens = {name: speculant.Generator(LoadedModel(m, None, "tiny"), make_drafter(drafter, m), gamma=4, **kw)
            for name, m, drafter, kw in (("blocks", blocks, "none", {}), ("core", model, "none", {}),
                                         ("core ngram", model, "ngram", {}),
                                         ("onednn", model, "none", {"kernels": "onednn"}))}
    outs = {name: gen.generate_ids(invariance_prompts(4), max_new_tokens=24) for name, gen in gens.items()}
    assert outs["core"][0].stats["cpu_kernels"].startswith("float32 on the kernel core")
    assert outs["onednn"][0].stats["cpu_kernels"].startswith("onednn")
    for name in ("core", "core ngram"):
        assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["blocks"]], name
        assert outs[name][0].stats["exact"] == "bitwise"
    assert sum(o.stats["accepted_draft_tokens"] for o in outs["core ngram"]) > 0
    fasts = [gens[name].backend.fast for name in ("blocks", "core")]
    assert torch.equal(_last_step_logits(fasts[0], prompt), _last_step_logits(fasts[1], prompt))
    attn = model.model.layers[1].self_attn
    stacked = fasts[1].pass_set.layers[1]["quantized"]["qkv"].weight.tensor
    again = gens["core ngram"].backend.fast.pass_set.layers[1]["quantized"]["qkv"].weight.tensor
    assert attn.q_proj.weight.data_ptr() == stacked.data_ptr() == again.data_ptr()  # a second fast path: no copy
    assert torch.equal(attn.q_proj.weight, q_before)
    assert attn.v_proj.weight.data_ptr() == stacked[-attn.v_proj.weight.shape[0]:].data_ptr()
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompt])).logits, before)


@needs_kernel
def test_drafters_beside_a_float32_target_on_the_kernels_draft_on_the_int8_kernels(tmp_path, monkeypatch):
    """Beside a float32 model on the kernel core, draft networks run on the int8 kernels as beside a
    quantized target (an EAGLE head's chain in one kernel call): plain decoding's text, alone and in a
    batch, γ 1, 4 and auto. ``SPECULANT_CPU_KERNELS=onednn`` keeps them float32."""
    model = _quantized_tiny(seed=5, halves=True)
    del model.speculant_quantized
    assert quantized.drafts_on_kernels(model)
    drafter = invariance_drafter("eagle", model, tmp_path)
    assert drafter.kernel_layers is not None and drafter.chains
    plain = [o.token_ids for o in speculant.generate(model, invariance_prompts(4), drafter="none", max_new_tokens=24)]
    drafted = 0
    for gamma in (1, 4, "auto"):
        for batch in (1, 4):
            outs = speculant.generate(model, invariance_prompts(batch), drafter=drafter, gamma=gamma, max_new_tokens=24)
            assert [o.token_ids for o in outs] == plain[:batch], f"gamma={gamma} batch={batch}"
            assert outs[0].stats["exact"] == "bitwise"
            assert outs[0].stats["cpu_kernels"].startswith("float32 on the kernel core")
            drafted += sum(o.stats["draft_tokens"] for o in outs)
    assert drafted > 0
    monkeypatch.setenv(cpu_kernels.ENV, "onednn")
    assert not quantized.drafts_on_kernels(model)
    assert invariance_drafter("eagle", model, tmp_path / "dense").kernel_layers is None


@needs_kernel
def test_a_bf16_checkpoints_float32_model_streams_bfloat16_for_the_same_bits(monkeypatch):
    """A float32 model whose every weight is a bfloat16 value (a bf16 checkpoint loaded in float32)
    runs on bfloat16 copies of them: half the bytes a pass, and the tokens and logits of its float32
    weights exactly. A model with one weight that is not such a value keeps float32."""
    model = tiny_llama(seed=6, vocab=96, layers=2, hidden=64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    target = LoadedModel(model, None, "tiny")

    def run(drafter):
        gen = speculant.Generator(target, make_drafter(drafter, target), gamma=4)
        return gen, gen.generate_ids(invariance_prompts(4), max_new_tokens=24)

    halves, plain = run("none")
    _, drafted = run("ngram")
    monkeypatch.setattr(quantized, "BF16_WEIGHTS", False)
    whole, wide = run("none")
    assert "bfloat16 values" in plain[0].stats["cpu_kernels"]
    assert "bfloat16" not in wide[0].stats["cpu_kernels"]
    fasts = [halves.backend.fast, whole.backend.fast]
    assert fasts[0].pass_set.layers[0]["quantized"]["down"].weight.tensor.dtype == torch.bfloat16
    assert fasts[1].pass_set.layers[0]["quantized"]["down"].weight.tensor.dtype == torch.float32
    for outs in (drafted, wide):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    prompt = invariance_prompts(1)[0]
    assert torch.equal(_last_step_logits(fasts[0], prompt), _last_step_logits(fasts[1], prompt))
    monkeypatch.setattr(quantized, "BF16_WEIGHTS", True)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = 1.0 + 2.0 ** -20  # no bfloat16 value
    assert all(w.bits == 32 for w in quantized.dense_weights(model).values())


def test_quantized_needs_a_gguf_on_the_cpu(tmp_path):
    folder = save_tiny_folder(tmp_path / "tiny")
    with pytest.raises(SpeculantError, match="needs a .gguf model"):
        load_model(str(folder), device="cpu", dtype="quantized")
    if not torch.cuda.is_available():
        return
    with pytest.raises(SpeculantError, match="CPU only"):
        load_model("default", device="cuda", dtype="quantized")


@needs_kernel
def test_quantized_refuses_compile():
    model = _quantized_tiny()
    target = LoadedModel(model, None, "tiny-quantized")
    with pytest.raises(SpeculantError, match="compile does not apply"):
        speculant.Generator(target, make_drafter("none", target), compile=True)


@pytest.fixture(scope="module")
def quantized_default():
    return load_model("default", device="cpu", dtype="quantized")


@needs_kernel
@pytest.mark.slow
def test_default_gguf_is_read_exactly(quantized_default):
    """Every linear of the default target's Q4_1 GGUF (and its Q8_0 tied LM head) is kept quantized,
    q and k with llama.cpp's rotary row order undone: read() proved each equal to the dense weight."""
    weights = quantized_default.model.speculant_quantized
    assert len(weights) == 30 * 7 + 1
    assert {w.source for w in weights.values()} == {"Q4_1", "Q8_0"} and weights["lm_head"].source == "Q8_0"
    gen = speculant.Generator(quantized_default, make_drafter("none", quantized_default))
    assert gen.backend.info()["cpu_kernels"].startswith("quantized (float32 activations; Q4_1 x210, Q8_0 x1; ")
    # its shipped EAGLE head costs more than a quantized pass: prompt lookup is the default beside it
    assert shipped_drafter(quantized_default).endswith("+ngram") and default_drafter(quantized_default) == "ngram"


def test_gguf_tensors_are_ggufs_own_readers():
    """The tensor table read without making the metadata Python objects (gguf's reader takes seconds
    over a tokenizer's strings) gives each tensor's name, type, dims and bytes as gguf's reader does."""
    import gguf

    from speculant.models.gguf_file import gguf_tensors
    from speculant.models.loading import default_model_path

    path = default_model_path()
    ours, theirs = gguf_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs] and len(ours) == 272
    for a, b in zip(ours, theirs):
        assert (a.kind, a.dims) == (b.tensor_type.name, [int(d) for d in b.shape]), a.name
        raw = np.asarray(b.data)
        assert np.array_equal(a.data.reshape(-1), raw.view(np.uint8).reshape(-1)), a.name
        if a.kind.startswith("Q"):
            assert a.data.shape == raw.shape, a.name  # [rows, bytes a row], as from_gguf_blocks takes it


PROMPTS = ["Write a haiku about rivers", "What is 17 times 23? Explain step by step.",
           "Translate to French: The cat sleeps on the warm windowsill."]


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("drafter,gamma", [("shipped", 3), ("shipped", "auto"), ("ngram", 4), ("layerskip", 3),
                                           ("suffix", "auto")])
def test_default_quantized_speculative_equals_plain(quantized_default, drafter, gamma):
    plain = speculant.Generator(quantized_default, make_drafter("none", quantized_default))
    assert plain.backend.info()["exact"] == "bitwise"
    d = shipped_drafter(quantized_default) if drafter == "shipped" else drafter
    spec = speculant.Generator(quantized_default, make_drafter(d, quantized_default), gamma=gamma)
    ids = [plain.encode(p) for p in PROMPTS]
    want = [plain.generate_ids([i], max_new_tokens=32)[0].token_ids for i in ids]
    got = [spec.generate_ids([i], max_new_tokens=32)[0].token_ids for i in ids]
    assert got == want
    if gamma != "auto":  # auto may rightly switch a drafter off beside so cheap a target pass
        assert spec.generate_ids([ids[0]], max_new_tokens=32)[0].stats["accepted_draft_tokens"] > 0


def test_a_killed_builds_lock_is_taken_over_at_once(tmp_path):
    """PyTorch's build lock outlives a build killed midway, and its next build would wait on it forever:
    here the build lock is an flock, which a killed process lets go of, and PyTorch's lock found under
    it is removed at once (a killed build's: every build takes the flock first)."""
    import subprocess
    import sys
    import time

    from speculant.models import native

    folder = tmp_path / "py311_cpu" / "mod"
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # left by a build killed a moment ago
    said = []
    t0 = time.monotonic()
    with native.build_lock(tmp_path, "mod", said.append):
        assert not (folder / "lock").exists()
    assert time.monotonic() - t0 < 1 and any("killed build" in s for s in said)
    # a process killed while holding the lock: the next takes it over at once
    code = (f"import sys, time; sys.path.insert(0, {str(native.CSRC.parents[2])!r}); from speculant.models import native; "
            f"from pathlib import Path; c = native.build_lock(Path({str(tmp_path)!r}), 'mod'); c.__enter__(); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with native.build_lock(tmp_path, "mod", said.append):
        pass
    assert time.monotonic() - t0 < 1


def test_a_build_waits_for_another_live_build_and_says_so(tmp_path):
    import threading
    import time

    from speculant.models import native

    said, entered = [], threading.Event()

    def other():
        with native.build_lock(tmp_path, "mod", said.append):
            entered.set()
            time.sleep(0.4)

    threading.Thread(target=other).start()
    entered.wait()
    t0 = time.monotonic()
    with native.build_lock(tmp_path, "mod", said.append):
        waited = time.monotonic() - t0
    assert waited > 0.2 and any("waiting for another process's build" in s for s in said)


@needs_kernel
def test_a_short_prompt_prefills_through_the_pass_kernels(monkeypatch):
    """A prompt of up to QUANTIZED_PREFILL_MAX tokens runs as one block of the passes' kernels: its
    logits and cache are those of feeding it one token at a time; a longer one runs HF's computation."""
    from speculant.models import fast as fast_module

    model = _quantized_tiny(seed=4)
    fast = fast_module.FastLlama(model)
    toks = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        keys, values = fast.new_cache(1, 64)
        block = fast.prefill(toks, keys, values)
        k1, v1 = fast.new_cache(1, 64)
        steps = torch.cat([fast.forward(toks[:, i : i + 1], torch.tensor([[i]]), torch.tensor([[i]]), k1, v1)
                           for i in range(20)], 1)
        assert torch.equal(block, steps)
        assert all(torch.equal(a, b) for a, b in zip(keys + values, k1 + v1))
        monkeypatch.setattr(fast_module, "QUANTIZED_PREFILL_MAX", 10)
        long = fast.prefill(toks, *fast.new_cache(1, 64))
        assert not torch.equal(long, block)  # another computation: the dense weights, HF's matmuls
        torch.testing.assert_close(long, model(toks).logits, rtol=1e-4, atol=1e-4)
