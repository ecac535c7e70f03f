"""int8 activations (``dtype="q8"``, csrc/core/q8.h): each activation row quantized alone in blocks of
32 (llama.cpp's Q8_0 scheme), integer dot products per block, the float scales applied in one fixed
order.

- The quantization of a row equals a plain numpy reference bit for bit (ties to even included).
- The linear kernel equals a reference written with integer ops (exact block sums, then float64),
  closely enough that one integer off in any block fails it, on every ISA branch (AVX-512 with and
  without VNNI, AVX2, plain C++: csrc/harness adds NEON under qemu), at every width.
- A decoder layer over int8 linears is width-invariant.
- On a tiny quantized Llama in q8, every drafter gives plain q8 decoding's text (γ 1, 4, auto; alone
  and batched), and every prompt's prefill runs the same kernels as the steps after it.
- q8's KV cache is float16: written as float32's rounded to halves, and attended over with the bits
  of those values widened to float32.
"""
import functools

import numpy as np
import pytest
import torch

import speculant
from speculant.errors import SpeculantError
from speculant.models import quantized
from speculant.models.loading import load_model
from speculant.models.quantized import QuantLinear, QuantWeight
from helpers import save_tiny_folder
from test_invariance import KINDS as EVERY_DRAFTER, REJECTED, _prompts as invariance_prompts
from test_quantized import ISA, _drafter_for, _quantized_tiny, needs_kernel

def _has_amx() -> bool:
    from speculant.models.native import _cpu_flags

    return {"amx_tile", "amx_int8", "avx512_vnni"} <= _cpu_flags()


# AVX-512 without VNNI; with VNNI and no AMX (on an AMX Xeon native runs blocks wider than one vpdpbusd
# tile, 9+ rows of 4-bit weights and 7+ of 8-bit, on its tiles: arch/x86/amx.h); where the CPU has AMX,
# its tiles at every width
Q8_ISA = ISA | {"avx512-novnni": ("-mno-avx512vnni",), "avx512-vnni": ("-mno-amx-tile", "-mno-amx-int8")} | (
    {"amx-every-width": ("-DSPK_Q8_AMX_FROM_ROWS=1",)} if _has_amx() else {})


@pytest.fixture(params=sorted(Q8_ISA))
def q8_kernels(request, monkeypatch):
    import platform

    if request.param != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ISA flags for x86 only")
    module = quantized.build(Q8_ISA[request.param])
    if module is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    monkeypatch.setattr(quantized, "kernels", lambda: module)
    return module


def reference_quantize(x: np.ndarray):
    """x [M, K] float32 -> (codes int8, d float32 [M, K/32], sums int64): max|x| / 127, x * (1 / d)
    rounded to nearest (ties to even), all in float32 as the kernel computes it."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint((b * inv[..., None]).astype(np.float32)).astype(np.int64)
    return q.reshape(x.shape), d, q.sum(-1)


def reference_linear(x: torch.Tensor, w: QuantWeight, bias) -> torch.Tensor:
    """Integer block sums of codes and quantized x (exact, int64), scaled in float64."""
    q, d, sums = reference_quantize(x.numpy())
    n, k = w.shape
    codes = w.signed_codes().to(torch.int64).view(n, k // 32, 32)
    qx = torch.from_numpy(q).view(x.shape[0], k // 32, 32)
    dots = torch.einsum("mbk,nbk->mnb", qx, codes).double()  # exact integers
    d, sums = torch.from_numpy(d).double(), torch.from_numpy(sums).double()
    y = (dots * (w.scale.double()[None] * d[:, None])).sum(-1) + (w.min.double()[None] * (d * sums)[:, None]).sum(-1)
    return y + (0 if bias is None else bias.double())


@needs_kernel
def test_a_rows_quantization_is_the_references(q8_kernels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 128, generator=g) * torch.tensor([0.01, 1.0, 30.0, 1e-6]).repeat_interleave(32)
    x[3, :32] = 0  # a block of zeros: d = 0, every code 0
    x[4, :32] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5] + [1.0] * 26)  # d = 1: ties go to even
    q, d, sums = q8_kernels.q8_quantize(x)
    rq, rd, rsums = reference_quantize(x.numpy())
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd) and np.array_equal(sums.numpy(), rsums)
    assert q[4, 1:6].tolist() == [2, 4, 0, -2, 0]


def _as_halves(w: QuantWeight) -> QuantWeight:
    """``w`` with scales and mins rounded to float16, as GGUF's Q4_0, Q4_1 and Q8_0 store them."""
    return QuantWeight(w.codes, w.scale.half().float(), w.min.half().float(), w.bits, w.source)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("half_scales", [False, True])
@pytest.mark.parametrize("out_features,in_features,bias", [(96, 64, False), (150, 544, True), (13, 32, False)])
def test_int8_linear_width_invariant_and_the_integer_reference(q8_kernels, bits, half_scales, out_features,
                                                                in_features, bias):
    g = torch.Generator().manual_seed(bits)
    w = QuantWeight.quantize(torch.randn(out_features, in_features, generator=g), bits)
    w = _as_halves(w) if half_scales else w
    b = torch.randn(out_features, generator=g) if bias else None
    lin = QuantLinear(w, b, int8=True)
    # bytes a block of 16 outputs: scales (and mins) in float16 where they are halves
    assert lin.args[0].shape[-1] == {(4, False): 384, (4, True): 320, (8, False): 576, (8, True): 544}[bits, half_scales]
    x = torch.randn(70, in_features, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    for m in list(range(1, 18)) + [31, 32, 33, 64, 70]:
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
        assert torch.equal(lin(x[len(x) - m :]), alone[len(x) - m :]), f"the last {m} rows"
    want = reference_linear(x, w, b)
    # float32 rounding of ~17 block terms stays under 1e-4 here; one integer off in one block
    # moves an output by scale * d, over 4e-3 for these weights
    torch.testing.assert_close(alone.double(), want, rtol=0, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_give_the_float32_layouts_bits(q8_kernels, bits):
    g = torch.Generator().manual_seed(3)
    w = _as_halves(QuantWeight.quantize(torch.randn(150, 544, generator=g) * 3, bits))
    x = torch.randn(11, 544, generator=g)
    halves, floats = QuantLinear(w, int8=True), QuantLinear(w, int8=True)
    floats.args = [quantized.pack_int8(w, halves=False), floats.args[1]]
    assert halves.args[0].numel() < floats.args[0].numel()
    assert torch.equal(halves(x), floats(x))


@needs_kernel
def test_the_compiled_argmax_is_pytorchs_max_indices(q8_kernels, monkeypatch):
    """Greedy decoding's argmax (sampling.argmax takes the kernel's where it is loaded): the first of
    equal values, the first NaN, infinities, every row length around the vector width, a vocabulary."""
    from speculant import sampling

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(3, 5, 49152, generator=g), torch.randn(2, 1, generator=g)]
    for n in range(1, 70):
        cases.append(torch.randint(-3, 3, (8, n), generator=g).float())  # many ties
        cases.append(torch.full((2, n), float("-inf")))
    x = torch.randn(8, 100, generator=g)
    x[0, 17] = x[0, 50] = x[1, 99] = x[2, 3] = float("nan")
    x[3, :] = float("-inf")
    x[4, 7] = x[4, 60] = float("inf")
    x[5] = -0.0
    x[5, 9] = 0.0
    cases.append(x)
    for x in cases:
        assert torch.equal(q8_kernels.argmax(x), x.max(-1).indices), x.shape
    best = cases[0].max(-1).indices  # greedy acceptance's argmax (one call: tests/test_verify_tree.py) is this one
    drafts = best[:, :4].clone()
    drafts[1, 2] += 1
    n, nxt, _ = q8_kernels.greedy_accept(cases[0], drafts, torch.empty(0, dtype=torch.long), torch.tensor([4, 4, 1]))
    assert n.tolist() == [4, 2, 1] and nxt.tolist() == [best[0, 4], best[1, 2], best[2, 1]]
    calls = []
    monkeypatch.setattr(sampling, "_compiled_argmax", lambda x: calls.append(x) or q8_kernels.argmax(x))
    assert torch.equal(sampling.argmax(cases[0]), cases[0].max(-1).indices) and calls
    monkeypatch.setattr(sampling, "_compiled_argmax", None)  # no kernels loaded in this process: PyTorch's
    assert torch.equal(sampling.argmax(cases[0]), cases[0].max(-1).indices)


def test_every_isa_branch_gives_the_same_int8_bits(monkeypatch):
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ISA flags for x86 only")
    g = torch.Generator().manual_seed(11)
    outs = {}
    for bits, halves in ((4, False), (8, False), (4, True), (8, True)):
        w = QuantWeight.quantize(torch.randn(150, 544, generator=g), bits)
        w = _as_halves(w) if halves else w
        x = torch.randn(9, 544, generator=g)
        for name, flags in Q8_ISA.items():
            module = quantized.build(flags)
            if module is None:
                pytest.skip("no C++ compiler for the CPU kernels")
            monkeypatch.setattr(quantized, "kernels", lambda: module)
            # every tiling: one row, tiles of 4 and what is left, one wider tile (AVX2: 5, AVX-512: up to 8;
            # AMX: a tile of up to 16)
            outs[name] = [QuantLinear(w, int8=True)(x[:m]) for m in range(1, 10)]
        for n in Q8_ISA:
            assert all(torch.equal(a, b) for a, b in zip(outs[n], outs["native"])), (n, bits, halves)
        assert all(torch.equal(outs["native"][m - 1], outs["native"][-1][:m]) for m in range(1, 10)), (bits, halves)


@needs_kernel
def test_an_int8_layer_is_width_invariant(q8_kernels):
    k = q8_kernels
    g = torch.Generator().manual_seed(0)
    H, heads, kv, D, inter, eps = 64, 4, 2, 16, 128, 1e-5
    lin = {n: QuantLinear(QuantWeight.quantize(torch.randn(o, i, generator=g) * 0.2, bits), int8=True)
           for n, o, i, bits in (("qkv", (heads + 2 * kv) * D, H, 4), ("o", H, heads * D, 8),
                                 ("gu", 2 * inter, H, 4), ("down", H, inter, 4))}
    ln = 1 + 0.1 * torch.randn(H, generator=g)
    M = 19
    h, attn = torch.randn(M, H, generator=g), torch.randn(M, heads * D, generator=g)
    ang = torch.rand(M, D // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()

    def start(r):
        return k.layer_start(h[r], ln, eps, lin["qkv"].args, 4, cos[r], sin[r], heads + kv, D)

    def end(r):
        return k.layer_end(h[r], attn[r], lin["o"].args, 8, ln, eps, lin["gu"].args, 4, lin["down"].args, 4)

    for fn in (start, end):
        alone = torch.cat([fn(slice(i, i + 1)) for i in range(M)])
        for m in (2, 3, 4, 5, 8, 19):
            assert torch.equal(fn(slice(0, m)), alone[:m])


def _q8_tiny(seed: int = 0):
    model = _quantized_tiny(seed)
    model.speculant_int8 = True
    return model


@functools.cache
def _tiny_plain_q8() -> list[list[int]]:
    return [speculant.generate(_q8_tiny(), [p], drafter="none", max_new_tokens=32)[0].token_ids
            for p in invariance_prompts(4)]


@needs_kernel
@pytest.mark.parametrize("kind", EVERY_DRAFTER)
def test_tiny_q8_speculative_equals_plain_with_every_drafter(tmp_path, kind):
    target = _q8_tiny()
    plain = _tiny_plain_q8()
    accepted = 0
    for gamma in (1, 4, "auto"):
        for batch in (1, 4):
            outs = speculant.generate(target, invariance_prompts(batch), drafter=_drafter_for(kind, target, tmp_path),
                                      gamma=gamma, max_new_tokens=32)
            for i, out in enumerate(outs):
                assert out.token_ids == plain[i], f"{kind} gamma={gamma} batch={batch} row {i}"
                assert out.stats["exact"] == "bitwise" and out.stats["cpu_kernels"].startswith("q8 (int8")
            accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
    if kind not in REJECTED:  # random networks' drafts (DFlash blocks, MTP layers, ...) are rightly rejected
        assert accepted > 0, "no draft was ever accepted"


@needs_kernel
@pytest.mark.parametrize("extra", [5, 300])  # 300: a block whose attention widens the float16 values once
def test_every_prompt_prefills_through_the_int8_kernels(extra):
    """In q8 a prompt of any length runs the passes' kernels: its logits and cache are those of
    feeding it one token at a time (the mode is int8 arithmetic throughout)."""
    from speculant.models import fast as fast_module

    fast = fast_module.FastLlama(_q8_tiny(seed=4))
    n = fast_module.QUANTIZED_PREFILL_MAX + extra
    toks = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        keys, values = fast.new_cache(1, n + 4)
        block = fast.prefill(toks, keys, values)
        k1, v1 = fast.new_cache(1, n + 4)
        steps = torch.cat([fast.forward(toks[:, i : i + 1], torch.tensor([[i]]), torch.tensor([[i]]), k1, v1)
                           for i in range(n)], 1)
    assert torch.equal(block, steps)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, k1 + v1))


@needs_kernel
def test_q8_keeps_its_cache_in_float16():
    """q8's cache is float16 (half the bytes a long context's attention reads): the keys and values
    its first layer writes are those a float32 cache of the same model holds, rounded to halves, and
    the state's size counts two bytes a value."""
    from speculant.models.backend import Backend, kv_bytes
    from speculant.models.fast import FastLlama

    model = _q8_tiny(seed=4)
    fast, wide = FastLlama(model), FastLlama(model)
    wide.cache_dtype = torch.float32  # the kernels take either cache
    toks = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        caches = [f.new_cache(1, 48) for f in (fast, wide)]
        logits = [f.prefill(toks, *c) for f, c in zip((fast, wide), caches)]
    (keys, values), (keys32, values32) = caches
    assert keys[0].dtype == values[0].dtype == torch.float16 and keys32[0].dtype == torch.float32
    assert torch.equal(keys[0], keys32[0].half()) and torch.equal(values[0], values32[0].half())
    assert not torch.equal(logits[0], logits[1])  # the rounding reaches the logits: this is q8's own text
    assert Backend(model).state_bytes(2, 256) == kv_bytes(model, 2, 256, element=2) == kv_bytes(model, 2, 256) // 2


@needs_kernel
@pytest.mark.parametrize("queries,tree", [(1, False), (5, True), (300, False)])
def test_attention_over_a_float16_cache_is_over_its_values_widened(queries, tree):
    """The kernel's attention of float32 queries over float16 keys and values gives the bits of the
    same values widened to float32 (every half is a float), for a step, a tree's block and a prompt's."""
    from speculant.models.cpu_attention import attend

    g = torch.Generator().manual_seed(queries)
    B, H, Hkv, D, S = 2, 9, 3, 64, queries + 40
    q = torch.randn(B, H, queries, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).half() for _ in range(2))
    count = (torch.arange(queries) + 30)[None].repeat(B, 1) + torch.arange(B)[:, None]
    slots = None
    if tree:  # each query's keys gathered from anywhere in the cache
        slots = torch.stack([torch.randperm(S, generator=g)[None].repeat(queries, 1) for _ in range(B)])
    got = attend(q, k, v, slots, count, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, attend(q, k.float(), v.float(), slots, count, 0.125))


def test_q8_needs_a_gguf_on_the_cpu(tmp_path):
    folder = save_tiny_folder(tmp_path / "tiny")
    with pytest.raises(SpeculantError, match="'q8' needs a .gguf model"):
        load_model(str(folder), device="cpu", dtype="q8")


def test_q8_needs_the_compiled_kernels(monkeypatch):
    from speculant.models import loading

    monkeypatch.setattr(loading, "_LOADED", {})  # a q8 model an earlier test loaded is not handed back
    monkeypatch.setattr(quantized, "kernels", lambda: None)
    with pytest.raises(SpeculantError, match="needs the compiled CPU kernels"):
        load_model("default", device="cpu", dtype="q8")


@needs_kernel
def test_the_eagle_head_on_the_kernels_computes_its_own_forward(tmp_path):
    """Beside a quantized target an EAGLE head runs its layer as one kernel call (KernelLayers): the
    same network as its PyTorch forward over the same int8 linears, on a chain's and a tree's masks
    (its states equal but for float rounding; it is a drafter: only its proposals depend on it)."""
    target = _q8_tiny()
    drafter = _drafter_for("eagle", target, tmp_path)
    assert drafter.kernel_layers is not None
    net, g = drafter.net, torch.Generator().manual_seed(0)
    attn = net.layers[0].self_attn
    B, T, S, H = 2, 4, 24, net.fc.weight.shape[0]
    keys = [torch.randn(B, attn.kv_heads, S, attn.head_dim, generator=g) for _ in net.layers]
    values = [torch.randn(B, attn.kv_heads, S, attn.head_dim, generator=g) for _ in net.layers]
    embeds, hidden = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    positions = torch.tensor([[9, 10, 11, 12], [5, 6, 7, 8]])
    chain = torch.arange(S)[None, None] <= positions[..., None]
    tree = chain & (torch.rand(B, T, S, generator=g) < 0.7) | (torch.arange(S)[None, None] == positions[..., None])

    def run(at, mask, kernels: bool):
        drafter.keys, drafter.values = [k.clone() for k in keys], [v.clone() for v in values]
        layers, drafter.kernel_layers = drafter.kernel_layers, drafter.kernel_layers if kernels else None
        try:
            out = drafter._step(embeds, hidden, at, positions, S, mask[:, None])
        finally:
            drafter.kernel_layers = layers
        return out, drafter.keys + drafter.values

    # a chain; a tree's nodes (each its own visible slots), at their positions or one a row (a depth)
    for at, mask in ((positions, chain), (positions, tree), (positions[:, :1], tree)):
        (state, normed), caches = run(at, mask, True)
        (want_state, want_normed), want_caches = run(at, mask, False)
        torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(normed, want_normed, rtol=1e-4, atol=1e-4)
        for got, want in zip(caches, want_caches):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_eagle_heads_rotary_table_gives_each_position_its_formulas_values(tmp_path):
    """The chain kernel reads cos and sin from a table grown as texts grow: each row exactly what
    the head's formula gives that position in a call of its own or in a block."""
    from speculant.models.fast import position_table

    layers = _drafter_for("eagle", _q8_tiny(), tmp_path).kernel_layers
    g = torch.Generator().manual_seed(0)
    for below in (40, 300, 1000):
        table = position_table(None, below, layers.rope, "cpu")
        block = torch.randint(below, (3, 5), generator=g)
        for rows, want, alone in zip(table, layers.rope(block), layers.rope(block[1:2, 2:3])):
            assert torch.equal(rows[block], want) and torch.equal(rows[block][1:2, 2:3], alone)
    assert table[0].shape[0] == 1024


@needs_kernel
@pytest.mark.parametrize("gamma", [1, 3, 20])  # 20: past the first level's 8 siblings
def test_the_eagle_chain_in_one_call_proposes_the_trees_chain(tmp_path, monkeypatch, gamma):
    """Beside a quantized target the EAGLE head's whole proposal is one kernel call (``eagle_chain``:
    the catch-up, then a chain of head steps). Its proposals are those of the tree drafter with one
    node expanded a depth (BEAM 1: the chain, each level's TOP_K siblings offered), pass after pass
    of a batched generation: the same nodes under the same parents, the same probabilities but for
    float rounding, and the same text (plain q8 decoding's)."""
    from speculant.drafters import eagle as eagle_module

    target = _q8_tiny()

    def run(chains: bool):
        drafter = _drafter_for("eagle", target, tmp_path)
        assert drafter.chains
        drafter.chains = chains
        seen, propose = [], drafter.propose_among
        drafter.propose_among = lambda g, rivals: seen.append(propose(g, rivals)) or seen[-1]
        with monkeypatch.context() as m:
            m.setattr(eagle_module, "BEAM", 1)
            m.setattr(eagle_module, "MIN_SCORE", 0.0)  # a random head's chains are unlikely: deepen all the same
            outs = speculant.generate(target, invariance_prompts(3), drafter=drafter, gamma=gamma, max_new_tokens=24)
        return [o.token_ids for o in outs], seen

    def nodes(p, row):  # each node's path of tokens from the root -> its probability
        n = int(p.lengths[row])
        paths = []
        for i in range(n):
            parent = int(p.parents[row, i])
            paths.append((paths[parent] if parent >= 0 else ()) + (int(p.tokens[row, i]),))
        return {path: float(p.scores[row, i]) for i, path in enumerate(paths)}

    text, chained = run(True)
    want_text, trees = run(False)
    assert text == want_text == [t[:24] for t in _tiny_plain_q8()[:3]]
    assert len(chained) == len(trees) and chained
    for got, want in zip(chained, trees):
        for row in range(got.tokens.shape[0]):
            a, b = nodes(got, row), nodes(want, row)
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) <= 1e-4 * max(1.0, b[k]) for k in a)


@needs_kernel
def test_the_eagle_chain_gives_a_row_the_same_bits_alone_beside_another_and_on_every_isa(tmp_path, monkeypatch):
    """``eagle_chain`` (catch-up, chain steps, softmax and top-K a row at a time): a row's draft ids
    and log-probabilities are the same bits alone and beside another row, on every x86 ISA branch
    (forced builds; the layer kernels it calls are checked under qemu for NEON)."""
    import platform

    from speculant.drafters import eagle as eagle_module

    monkeypatch.setattr(eagle_module, "MIN_SCORE", 0.0)  # every level, however unlikely the random head's chain
    target, g = _q8_tiny(), torch.Generator().manual_seed(1)
    B, W, S, levels = 2, 3, 40, 4
    net = _drafter_for("eagle", target, tmp_path).net
    attn = net.layers[0].self_attn
    feats = torch.randn(B, W, len(net.taps), target.config.hidden_size, generator=g)
    tokens = torch.randint(0, target.config.vocab_size, (B, W), generator=g)
    keys, values = (torch.randn(B, attn.kv_heads, S, attn.head_dim, generator=g) for _ in range(2))
    lengths = torch.tensor([7, 12])

    def chain(drafter, rows):
        return drafter.kernel_layers.chain(feats[rows], tokens[rows].flatten().tolist(), lengths[rows].tolist(),
                                           [W] * len(rows), S - 1, levels, 9, [keys[rows].clone()],
                                           [values[rows].clone()], drafter.embed.weight, None)

    builds = {}
    for name in sorted(Q8_ISA) if platform.machine() in ("x86_64", "AMD64") else ["native"]:
        module = quantized.build(Q8_ISA[name])
        if module is None:
            pytest.skip("no C++ compiler for the CPU kernels")
        monkeypatch.setattr(quantized, "kernels", lambda: module)
        drafter = _drafter_for("eagle", target, tmp_path)  # its linears and layers on this build's kernels
        assert drafter.chains
        both, first, second = chain(drafter, [0, 1]), chain(drafter, [0]), chain(drafter, [1])
        assert both[0].shape == (B, levels, eagle_module.TOP_K)
        for row, alone in enumerate((first, second)):  # draft ids, log-probs, the tree's ids, sizes, parents, probs
            assert all(torch.equal(x[row], y[0]) for x, y in zip(both, alone)), (name, row)
        builds[name] = both
        # the tree, best first, is the order EagleDrafter._best_first gives the same levels
        ids, lp, *tree = both
        want = drafter._best_first(ids.flatten(1), _chain_scores(lp), *_chain_shape(ids), 9)
        assert all(torch.equal(x, y) for x, y in zip(tree[:3], (want.tokens, want.lengths, want.parents)))
        assert torch.allclose(tree[3], want.scores, rtol=1e-6, atol=0)
    native = builds.pop("native")
    for name, other in builds.items():
        assert all(torch.equal(x, y) for x, y in zip(native, other)), name


def _chain_scores(lp: torch.Tensor) -> torch.Tensor:
    """The log-probability of each node of a chain's levels and their siblings [B, L * K]: the chain's
    to the level above, plus its own (the drafter's arithmetic before the kernel sorted its tree)."""
    best = lp[:, :, 0].cumsum(1)
    return (torch.cat([best.new_zeros(lp.shape[0], 1), best[:, :-1]], 1)[..., None] + lp).flatten(1)


def _chain_shape(ids: torch.Tensor) -> tuple[list, list]:
    """Per row, each candidate's parent (the chain's node a level up) and depth."""
    B, L, K = ids.shape
    parent = [(level - 1) * K if level else -1 for level in range(L) for _ in range(K)]
    depth = [level + 1 for level in range(L) for _ in range(K)]
    return [parent] * B, [depth] * B


@needs_kernel
def test_the_eagle_chains_tree_breaks_ties_as_the_drafter_did(tmp_path):
    """Equal scores (a head sure of a token: log-probability 0 down the chain; unreachable ids at
    -inf) order as ``_best_first`` orders them: the shallower first, then the earlier sibling. A
    tied chain is forced by handing the kernel the same levels through ``_best_first``'s own
    inputs: the kernel's tree for a γ is checked against the Python order for every budget."""
    drafter = _drafter_for("eagle", _q8_tiny(), tmp_path)
    k = drafter.kernel_layers.k
    lp = torch.tensor([[[0.0, -1.0, -1.0, float("-inf")], [0.0, -1.0, -2.0, -1.0], [-1.0, -1.0, -1.0, -1.0]]])
    ids = torch.arange(12).view(1, 3, 4)
    for budget in range(1, 13):
        got = k.chain_tree(ids, lp, budget, torch.empty(0, dtype=torch.long))
        want = drafter._best_first(ids.flatten(1), _chain_scores(lp), *_chain_shape(ids), budget)
        assert torch.equal(got[0], want.tokens) and torch.equal(got[2], want.parents), budget
        assert torch.equal(got[1], want.lengths) and torch.allclose(got[3], want.scores, rtol=1e-6, atol=0), budget


@needs_kernel
@pytest.mark.parametrize("int8", [True, False])  # q8, and quantized (float32 activations)
def test_every_layer_in_one_call_gives_the_bits_of_a_call_a_layer(q8_kernels, monkeypatch, int8):
    """A pass runs every bound layer in one kernel call (BoundLayers), and with the model's ends
    bound the whole pass (embeddings, rotary rows, layers, final norm, LM head: ``run_pass``): the
    logits and caches of a prefill, a verify block beside another row, a token tree, passes of the
    last row only and a pass with taps (the layers' inputs an EAGLE head reads, the normed output)
    are those of one call a layer, on every x86 ISA branch (forced builds)."""
    from speculant.models import fast as fast_module

    model = _q8_tiny(seed=6) if int8 else _quantized_tiny(6)
    g = torch.Generator().manual_seed(6)
    toks = torch.randint(0, 96, (2, 30), generator=g)
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]] * 2, dtype=torch.bool)

    def passes(how: str):
        fast = fast_module.FastLlama(model)
        calls = []
        if how == "a call a layer":
            fast.pass_set.all_layers = None
        else:
            bound = fast.pass_set.all_layers()
            assert bound.whole_passes  # the tiny model's LM head is of the GGUF's blocks
            bound.whole_passes = how == "whole passes"
            for name in ("__call__", "run_pass"):
                run = getattr(fast_module.BoundLayers, name)
                monkeypatch.setattr(fast_module.BoundLayers, name,
                                    lambda *a, run=run, name=name: calls.append(name) or run(*a))
        with torch.no_grad():
            keys, values = fast.new_cache(2, 40)
            first = torch.arange(20).repeat(2, 1)
            out = [fast.forward(toks[:, :20], first, first, keys, values)]
            pos = torch.tensor([[20, 21, 22], [20, 21, 22]])
            out.append(fast.forward(toks[:, 20:23], pos, pos, keys, values))
            at = torch.tensor([[23, 24, 25, 26]] * 2)
            out.append(fast.forward(toks[:, 23:27], torch.tensor([[23, 24, 24, 25]] * 2), at, keys, values, tree=tree))
            pos = torch.tensor([[27, 28, 29]] * 2)  # with an EAGLE head's taps: layers' inputs, the normed output
            out.extend(fast.forward(toks[:, 27:30], pos, pos, keys, values, taps=(0, 1, fast.n_layers)))
            pos = torch.tensor([[30, 31], [30, 31]])  # the last row's logits only, with and without taps
            out.append(fast.forward(toks[:, 3:5], pos, pos, keys, values, last_only=True))
            out.extend(fast.forward(toks[:, 5:7], pos + 2, pos + 2, keys, values, last_only=True, taps=(fast.n_layers, 1)))
        return out, keys + values, calls

    per_layer, caches_per_layer, _ = passes("a call a layer")
    for how, call in (("every layer in one call", "__call__"), ("whole passes", "run_pass")):
        one, caches, calls = passes(how)
        assert calls == [call] * 6, how  # each pass in one call
        assert all(torch.equal(a, b) for a, b in zip(one, per_layer, strict=True)), how
        assert all(torch.equal(a, b) for a, b in zip(caches, caches_per_layer)), how


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_a_trees_key_layout_in_one_call_is_the_pytorch_layouts(seed):
    """``tree_layout`` (the kernels' layout of a token tree's block, FastLlama.forward's on a CPU) gives
    every query the order and count of ``invariant.key_layout`` over the visibility forward built
    in PyTorch ops: random trees of 1-12 nodes written from different slots, a block past a key block."""
    from speculant.models import invariant
    from speculant.tree import block_layout

    g = torch.Generator().manual_seed(seed)
    B, N = 3, int(torch.randint(1, 13, (1,), generator=g))
    parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)])
                           for _ in range(B)])
    _, tree = block_layout(parents)  # [B, N + 1, N + 1]: the root and its nodes
    w = N + 1
    start = torch.randint(0, 90, (B,), generator=g)
    S = int(start.max()) + w  # the slots the pass reads
    rel = torch.arange(S)[None, None, :] - start[:, None, None]
    visible = (rel < 0) | (tree.gather(2, rel.clamp(0, w - 1).expand(B, w, S)) & (rel < w))
    want = invariant.key_layout(visible.sum(-1), torch.float32, visible)
    got = invariant.tree_key_layout(start, tree, S, torch.float32, kernels=quantized.kernels())
    assert (got.span, got.width) == (want.span, want.width)
    assert torch.equal(got.count, want.count) and torch.equal(got.order, want.order)
    assert got.shared_blocks <= want.shared_blocks
    plain = invariant.tree_key_layout(start, tree, S, torch.float32)  # without the kernels: PyTorch ops
    assert torch.equal(plain.order, want.order) and plain.shared_blocks == want.shared_blocks
