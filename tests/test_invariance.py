"""Width invariance (speculant.models.invariant): a row of the forward gets the bits it gets alone,
whatever the block width, the batch beside it or the tree around it. So speculative output is plain
decoding's bit for bit in bfloat16 as in float32, with every drafter, γ and batch, and repeats.

Kernel level: each choice, checked on random data across widths, and shown able to fail on a
deliberately width-dependent kernel. End to end: greedy text of every drafter equals plain decoding."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import speculant
from speculant.drafters import CascadeDrafter, LayerSkipDrafter, ModelDrafter, NgramDrafter
from speculant.drafters.dflash import load_dflash
from speculant.drafters.eagle import load_eagle
from speculant.drafters.hybrid import HybridDrafter
from speculant.drafters.medusa import load_medusa
from speculant.drafters.mtp import load_mtp
from speculant.models import cpu_attention, cpu_kernels, invariant
from speculant.models.cpu_kernels import PackedLinear
from speculant.models.fast import FastLlama, _rms_norm
from speculant.models.invariant import Attention, FLinear, RowLinear, Rows
from speculant.models.kv import KVState
from helpers import perturbed, tiny_llama
from test_dflash import _random_drafter_folder
from test_drafters_extra import make as make_extra
from test_eagle import _random_eagle_folder
from test_medusa import _random_medusa_folder
from test_mtp import _random_mtp_folder

BF16 = torch.bfloat16


# ---- rows windows -------------------------------------------------------------------------------

def test_rows_pads_short_calls_and_cuts_long_ones():
    seen = []

    def fn(x):
        seen.append(x.shape[0])
        return x * 2

    x = torch.arange(10.0)[:, None]
    assert torch.equal(Rows(4, 4)(fn, x), x * 2)
    assert seen == [4, 4, 4]  # 4 + 4 + 2 padded to 4
    seen.clear()
    assert torch.equal(Rows(1, 64)(fn, x[:3]), x[:3] * 2) and seen == [3]


def _width_dependent(w, threshold=4):
    """A kernel whose sums change route past ``threshold`` rows (float64 inside, as some GEMMs block)."""
    return lambda x: (x.double() @ w.double().T).to(x.dtype) if x.shape[0] > threshold else x @ w.T


def test_a_width_dependent_matmul_is_caught_and_fenced_into_a_window():
    x, w = invariant._cancelling_inputs(130, 256, 64, torch.float32, "cpu")
    fn = _width_dependent(w)
    assert not invariant.rows_hold(fn, x, Rows(1, 64))  # the check sees it
    rows = invariant.choose_rows(fn, x)
    assert rows.lo > 4  # every call now takes the wide route, one row too
    layer = RowLinear(fn, rows)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    assert all(torch.equal(layer(x[:m]), alone[:m]) for m in (1, 3, 5, 16, 33, 70))


def test_a_failing_window_is_given_up_within_a_few_rows():
    """The one-row calls are made as the widths need them, narrowest first: a kernel that changes
    route past 4 rows fails at 5 after 5 one-row calls and 5 wider ones, not the 130 + 31 calls of
    every width (a big LM head's checks: most of a first request's time)."""
    x, calls = torch.randn(130, 8), []

    def counted(t):  # exact row by row up to 4 rows, another route past them
        calls.append(t.shape[0])
        return t * 2 if t.shape[0] <= 4 else t * 2 + 1e-3

    assert not invariant.rows_hold(counted, x, Rows(1, 64))
    assert sorted(calls) == [1] * 5 + [1, 2, 3, 4, 5]
    calls.clear()
    assert invariant.rows_hold(counted, x, Rows(8, 64))  # a window that holds: every width, as before
    assert len(calls) == 130 + sum(1 + (m > 64) + (m > 128) for m in invariant.WIDTHS)


def test_one_changed_row_inside_a_wide_block_fails_the_window():
    """Rows are compared one by one where they lie: a route that changes only row 2 of blocks wider
    than 8 is seen, and the other rows' equality does not hide it."""
    x = torch.randn(130, 8)

    def fn(t):
        out = t * 2
        if t.shape[0] > 8:
            out[2] += 1e-3
        return out

    assert not invariant.rows_hold(fn, x, Rows(1, 64))
    assert invariant.rows_hold(fn, x, Rows(1, 8), widths=(1, 2, 8, 16, 130))  # calls of <= 8 rows hold


def test_a_kernel_that_reads_other_rows_gets_a_call_a_row():
    x, w = invariant._cancelling_inputs(130, 64, 32, torch.float32, "cpu")
    assert invariant.choose_rows(lambda t: (t + 1e-3 * t.sum(0)) @ w.T, x) == Rows(1, 1)


def _kernels():
    """Every linear kernel the CPU fast path may run here: F.linear, and oneDNN's where it packs."""
    out = [("F.linear", FLinear, BF16), ("F.linear", FLinear, torch.float32)]
    if cpu_kernels.onednn_packs(torch.float32):
        out += [("fp32 packs", lambda w, b: PackedLinear(w, b, torch.float32, 8), torch.float32),
                ("fp32 packs of bf16", lambda w, b: PackedLinear(w, b, torch.float32, 8), BF16)]
    if cpu_kernels.onednn_packs(BF16):
        out += [("bf16 packs", lambda w, b: PackedLinear(w, b, BF16, 1), BF16)]
    return out


@pytest.mark.parametrize("name,make,dtype", _kernels(), ids=[k[0] + "-" + str(k[2])[6:] for k in _kernels()])
@pytest.mark.parametrize("shape", [(64, 96), (128, 64), (576, 960), (1536, 576)])
def test_each_linear_kernel_within_its_window_gives_every_row_its_bits(name, make, dtype, shape):
    """Widths 1..70 and every place in a call, on data that shows any change of summation order."""
    in_f, out_f = shape
    rows = invariant.linear_rows(name, make, dtype, in_f, out_f, False)
    x, w = invariant._cancelling_inputs(70, in_f, out_f, dtype, "cpu", seed=5)
    layer = RowLinear(make(w, None), rows)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    for m in range(1, 71):
        assert torch.equal(layer(x[:m]), alone[:m]), f"{name} {shape}: {m} rows within {rows}"
    three_d = layer(x[:24].view(2, 12, in_f))  # [B, T, K] as the forward calls it
    assert torch.equal(three_d.view(24, -1), alone[:24])


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_rms_norm_and_rotary_are_per_row(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    alone = torch.cat([_rms_norm(h[i : i + 1], w, 1e-5) for i in range(64)])
    for m in (2, 7, 16, 33, 64):
        assert torch.equal(_rms_norm(h[:m], w, 1e-5), alone[:m])
        assert torch.equal(_rms_norm(h[:m].view(1, m, -1), w, 1e-5)[0], alone[:m])
    fast = FastLlama(tiny_llama(0).to(dtype))
    pos = torch.arange(300)[None]
    cos_all = (torch.cat([pos[..., None].float() * fast.inv_freq.float()] * 2, -1).cos()).to(dtype)
    for p in (0, 17, 299):
        one = (torch.cat([pos[:, p : p + 1, None].float() * fast.inv_freq.float()] * 2, -1).cos()).to(dtype)
        assert torch.equal(one[0, 0], cos_all[0, p])
    # the passes' table (grown as texts grow) gives each position what the formula gives it in a pass
    for below in (300, 1000, 40):
        block = torch.randint(below, (3, 5), generator=g)
        one = block[1:2, 2:3]  # a one-token step's
        for got, want, alone in zip(fast.rotary(block, below), fast._rope(block), fast._rope(one)):
            assert got.dtype == dtype and got.shape == (3, 5, 1, fast.head_dim)
            assert torch.equal(got[:, :, 0], want) and torch.equal(got[1:2, 2:3, 0], alone)
    assert fast._rotary_table[0].shape[0] == 1024


# ---- attention ------------------------------------------------------------------------------------

def _modes():
    out = [("tiled", Rows(1, 64)), ("batched", Rows(1, 64)), ("per-query", Rows(1, 1))]
    return ([("kernel", Rows(1, 64))] if cpu_attention.kernel() is not None else []) + out


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 16)])
def test_the_attention_this_machine_chose_gives_every_query_its_bits(dtype, shape):
    attend = invariant.attention_choice(dtype, *shape)
    assert invariant.attention_holds(attend, dtype, *shape)


def _checked_blocks(attend, dtype, *shape):
    """The check's verdict on ``attend``, and every block it ran through it (its own data: rows of
    other lengths beside each other, chains and trees) with the outputs it got."""
    blocks = []

    def spy(q, keys, values, layout, scale):
        out = attend(q, keys, values, layout, scale)
        if q.shape[0] > 1:  # a block of rows (the one-query calls are the check's references)
            blocks.append((q, keys, values, layout, scale, out))
        return out

    return invariant.attention_holds(spy, dtype, *shape), blocks


def _each_query_got_its_bits_alone(attend, blocks) -> bool:
    """Apart from the check's own loop: every query of every block against the same query attended
    alone over exactly the keys its layout says it sees, in text order."""
    for q, keys, values, layout, scale, out in blocks:
        for b in range(q.shape[0]):
            for t in range(q.shape[2]):
                n = int(layout.count[b, t])
                slots = torch.arange(n) if layout.order is None else layout.order[b, t, :n]
                one = invariant.key_layout(torch.full((1, 1), n), q.dtype)
                alone = attend(q[b : b + 1, :, t : t + 1], keys[b : b + 1, :, slots], values[b : b + 1, :, slots],
                               one, scale)
                if not torch.equal(out[b : b + 1, :, t : t + 1], alone):
                    return False
    return True


def _mode_cases():
    """Every mode in bf16; the modes that hold only where the kernels allow in float32 too."""
    return [(m, BF16) for m in _modes()] + [(m, torch.float32) for m in _modes() if m[0] in ("tiled", "batched")]


@pytest.mark.parametrize("mode,dtype", _mode_cases(), ids=[f"{m[0]}-{str(d)[6:]}" for m, d in _mode_cases()])
def test_each_attention_mode_is_one_token_steps_bits_or_the_check_says_so(mode, dtype):
    """Modes exact by construction hold. The others (tiled, batched) hold where this CPU's kernels
    allow, and the check's verdict on them must be what its own blocks show, query by query: no
    where a query got other bits than alone (on an AVX-512 EPYC, float32 and bf16 at head dim 16),
    yes where none did."""
    attend = Attention(mode, mode)
    if mode[0] in ("kernel", "per-query"):
        assert invariant.attention_holds(attend, dtype, 4, 2, 16)
        return
    holds, blocks = _checked_blocks(attend, dtype, 4, 2, 16)
    assert blocks, "the check ran no block: it tested nothing"
    assert holds == _each_query_got_its_bits_alone(attend, blocks), f"{mode} {dtype}: the check says {holds}"


def test_a_width_dependent_attention_is_caught():
    def attend(q, k, v, layout, scale):  # rounds the scores through bf16 once more in blocks of 2+ queries
        out = invariant._attend(q, k, v, layout, scale)
        return out + (1e-2 * out if q.shape[2] > 1 else 0)

    assert not invariant.attention_holds(attend, BF16, 4, 2, 16, kinds=("chain",))
    assert not invariant.attention_holds(attend, BF16, 4, 2, 16, kinds=("tree",))


def test_a_query_that_sees_nothing_gets_no_nans():
    q, k, v = torch.randn(1, 4, 3, 16).to(BF16), torch.randn(1, 2, 64, 16).to(BF16), torch.randn(1, 2, 64, 16).to(BF16)
    visible = torch.zeros(1, 3, 64, dtype=torch.bool)
    visible[0, 1:, :10] = True  # query 0: a padding column
    for mode in _modes():
        out = Attention(mode, mode)(q, k, v, invariant.key_layout(visible.sum(-1), BF16, visible), 0.25)
        assert not out.isnan().any(), mode


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="no compiled CPU kernels here")
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_the_kernel_spreads_a_long_context_step_over_threads_with_the_same_bits(dtype):
    """A one-token step or a short block over a long context has few tasks (one a kv head), which the
    compiled attention spreads over the threads step by step (keys, softmaxes, heads); many tasks, or
    a long block, it runs a task a thread. A query gets the same bits either way, in a tree too."""
    from speculant.models import quantized

    k = quantized.kernels()
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, S = 9, 3, 64, 400
    keys, values = (torch.randn(6, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(6, H, 9, D, generator=g).to(dtype)
    count = torch.randint(280, S, (6, 9), generator=g)
    no_slots = torch.empty(0, dtype=torch.long)
    many = k.attend(q, keys, values, no_slots, count, 0.125)  # 18 tasks (6 rows x 3 kv heads): a task a thread
    long_block = k.attend(q[:1], keys[:1], values[:1], no_slots, count[:1], 0.125)  # 9 queries: two chunks
    for t in (0, 8):
        step = k.attend(q[:1, :, t : t + 1], keys[:1], values[:1], no_slots, count[:1, t : t + 1], 0.125)  # spread
        assert torch.equal(step, many[:1, :, t : t + 1]) and torch.equal(step, long_block[:, :, t : t + 1])
    short_block = k.attend(q[:2, :, :4], keys[:2], values[:2], no_slots, count[:2, :4], 0.125)  # 6 tasks: spread
    assert torch.equal(short_block, many[:2, :, :4])
    # a tree: each query's keys gathered by slots (its own after a shared prefix), spread or not
    slots = torch.arange(S).expand(6, 9, S).clone()
    slots[:, :, 250:] = torch.randperm(S - 250, generator=g) + 250
    many = k.attend(q, keys, values, slots, count, 0.125)
    tree = k.attend(q[:1, :, :3], keys[:1], values[:1], slots[:1, :3], count[:1, :3], 0.125)
    assert torch.equal(tree, many[:1, :, :3])


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="no compiled CPU kernels here")
@pytest.mark.parametrize("head_dim", [8, 24])
def test_the_kernel_takes_head_dims_its_16_float_rows_do_not_divide(head_dim):
    """Such heads (the tests' tiny models have 8) are padded with zeros: each query keeps one-token
    steps' bits, the result is attention's (within float32 rounding of PyTorch's), and the whole
    forward attends through the kernel (a query at a time in Python took a 24,000-row sampling
    test ~15 minutes on a 2-core Xeon)."""
    kernel = Attention(("kernel", Rows(1, 64)), ("kernel", Rows(1, 64)))
    g = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(3, 4, 5, head_dim, generator=g), *torch.randn(2, 3, 2, 40, head_dim, generator=g)
    count = torch.tensor([[36, 37, 38, 39, 40], [3, 4, 5, 6, 7], [20, 20, 21, 22, 40]])
    layout = invariant.key_layout(count, torch.float32)
    got = kernel(q, keys, values, layout, 0.3)
    assert got.shape == q.shape
    torch.testing.assert_close(got, invariant._attend_per_query(q, keys, values, layout, 0.3), rtol=1e-5, atol=1e-6)
    for dtype in (BF16, torch.float32):
        assert invariant.attention_holds(kernel, dtype, 4, 2, head_dim)
    fast = FastLlama(tiny_llama(3, layers=2, hidden=4 * head_dim))
    assert "compiled" in fast.invariance["attention"] and fast.proves_invariance(layers=(0, 1))


# ---- the whole forward ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("kernels", ["auto", "fp32-blocks", "aten"])
def test_blocks_trees_and_batches_get_one_token_steps_logits(dtype, kernels):
    """FastLlama.proves_invariance: a 12-token block, a 23-node tree holding it as a path, and the block
    beside another row of another length, against one-token steps (bit for bit)."""
    if kernels == "fp32-blocks" and not cpu_kernels.onednn_packs(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    fast = FastLlama(tiny_llama(3, layers=2).to(dtype), kernels=kernels)
    assert fast.proves_invariance(layers=(0, 1))
    assert fast.exact == "bitwise"


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_blocks_trees_and_batches_keep_their_bits_with_attention_in_pytorch_ops(dtype, monkeypatch):
    """Where no compiler builds the attention kernel, the modes this machine's check picks in PyTorch
    ops keep the whole forward invariant (head dims the kernel takes and one it does not)."""
    monkeypatch.setattr(invariant, "_cpu_kernel", lambda: None)
    monkeypatch.setattr(invariant, "_checked", lambda key, device, run, encode, decode: run())
    invariant.attention_choice.cache_clear()
    try:
        for hidden in (64, 32):  # head dims 16 and 8
            fast = FastLlama(tiny_llama(3, layers=2, hidden=hidden).to(dtype))
            assert "compiled" not in fast.invariance["attention"]
            assert fast.proves_invariance(layers=(0, 1)), fast.invariance
    finally:
        invariant.attention_choice.cache_clear()


def test_the_proof_fails_for_a_width_dependent_forward(monkeypatch):
    fast = FastLlama(tiny_llama(3, layers=2).to(BF16))

    def blocky(q, k, v, layout, scale):
        out = invariant._attend(q, k, v, layout, scale)
        return out * (1 + 1e-2 * (q.shape[2] > 1))

    monkeypatch.setattr(fast, "attention", blocky)
    assert not fast.proves_invariance()


def test_a_norm_whose_sum_follows_the_rows_is_fenced_into_a_window(monkeypatch):
    """As CUDA's float32 mean does from 13 rows up: the norms' check finds a window, and the whole
    forward is width-invariant again; without the window the proof fails."""
    import speculant.models.fast as fast_module

    plain = fast_module._rms_norm

    def blocky(x, weight, eps, rows=None):
        if rows is not None and not (rows.lo == 1 and x.numel() <= rows.hi * x.shape[-1]):
            return RowLinear(lambda t: blocky(t, weight, eps), rows)(x)
        out = plain(x, weight, eps)
        return out * 1.01 if x.numel() > 12 * x.shape[-1] else out

    monkeypatch.setattr(fast_module, "_rms_norm", blocky)
    monkeypatch.setattr(invariant, "_WINDOWS", {})
    monkeypatch.setattr(invariant, "_checked", lambda key, device, run, encode, decode: run())
    fast = FastLlama(tiny_llama(3, layers=2).to(BF16))
    assert fast.invariance["norms"] == "16-64 rows a call"
    assert fast.proves_invariance(layers=(0, 1))
    for w in fast.pass_set.layers:
        w["norm_rows"] = Rows(1, 64)
    assert not fast.proves_invariance(layers=(0, 1))


def test_general_path_rows_of_a_batch_get_their_bits_alone():
    target = tiny_llama(5, layers=2).to(BF16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 20, 67)]
    from speculant.drafters.model import left_pad

    tokens, valid = left_pad(prompts, torch.device("cpu"))
    batch = KVState(target, 3).append(tokens, valid)
    for b, p in enumerate(prompts):
        alone = KVState(target, 1).append(torch.tensor([p]))
        assert torch.equal(batch[b, -len(p) :], alone[0])


# ---- end to end: every drafter, γ, batch and path in bfloat16 ------------------------------------

def _prompts(batch):
    g = torch.Generator().manual_seed(107)
    out = [torch.randint(1, 96, (3 + 9 * i,), generator=g).tolist() for i in range(4)]
    out[0] = out[1][:5] * 5  # repeats: lookup drafts get accepted
    return out[:batch]


@functools.cache
def _target():
    return tiny_llama(7, layers=3).to(BF16)


def _fp32(target):
    return copy.deepcopy(target).float()  # a drafter's random folder is made from a float32 copy


def _drafter(kind, target, tmp_path):
    if kind in ("layerskip", "cascade-ngram", "cross-tokenizer"):
        return make_extra(kind, target, 0)
    if kind == "model":
        return ModelDrafter(perturbed(target, 0.3, seed=14))
    if kind == "model+ngram":
        from speculant.drafters.model import LookupFirstDrafter

        return LookupFirstDrafter(ModelDrafter(perturbed(target, 0.3, seed=14)))
    if kind == "eagle":
        return load_eagle(_random_eagle_folder(tmp_path, _fp32(target), scale=0.3), target, "tiny")
    if kind == "eagle+ngram":
        return HybridDrafter(load_eagle(_random_eagle_folder(tmp_path, _fp32(target), scale=0.3), target, "tiny"))
    if kind == "dflash":
        return load_dflash(_random_drafter_folder(tmp_path, _fp32(target)), target, "tiny")
    if kind == "medusa":
        return load_medusa(_random_medusa_folder(tmp_path, _fp32(target)), target, "tiny")
    if kind == "mtp":
        return load_mtp(_random_mtp_folder(tmp_path, _fp32(target)), target, "tiny")
    if kind in SPECULATORS_ONLY:  # built by speculators itself (speculant does not train these)
        kinds = pytest.importorskip("test_speculators_kinds", reason="speculators is not installed")
        theirs = kinds.peagle_model(_fp32(target)) if kind == "peagle" else kinds.dflash_variant(kind, _fp32(target))
        theirs.save_pretrained(tmp_path / kind)
        return speculant.drafters.make_drafter(f"{kind}:{tmp_path / kind}", speculant.models.LoadedModel(target, None,
                                                                                                          "tiny"))
    return kind  # ngram, ngram:tree, suffix


SPECULATORS_ONLY = ("peagle", "dflash2", "dspark", "xpress")
KINDS = ["ngram", "ngram:tree", "suffix", "model", "model+ngram", "layerskip", "cascade-ngram", "cross-tokenizer", "eagle",
         "eagle+ngram", "dflash", "medusa", "mtp", *SPECULATORS_ONLY]
# random networks whose drafts are (rightly) all rejected: their blocks are verified all the same
REJECTED = {"dflash", "mtp", *SPECULATORS_ONLY}


@functools.cache
def _plain(path):
    return [speculant.generate(_target(), [p], drafter="none", max_new_tokens=32, path=path)[0].token_ids
            for p in _prompts(4)]


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_speculative_text_is_plain_decodings_with_every_drafter(tmp_path, path, kind):
    target = _target()
    plain = _plain(path)
    accepted = drafted = 0
    for gamma in (1, 4, "auto"):
        for batch in (1, 4):
            outs = speculant.generate(target, _prompts(batch), drafter=_drafter(kind, target, tmp_path), gamma=gamma,
                                      max_new_tokens=32, path=path)
            for i, out in enumerate(outs):
                assert out.token_ids == plain[i], f"{kind} gamma={gamma} batch={batch} row {i}"
                assert out.stats["exact"] == "bitwise"
            accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
            drafted += sum(o.stats["draft_tokens"] for o in outs)
    assert drafted > 0, "nothing was drafted: no verify block was wider than one token"
    if kind not in REJECTED:
        assert accepted > 0, "no draft was ever accepted"


def test_the_same_request_under_gamma_auto_gives_one_text():
    target = _target()
    texts = {tuple(speculant.generate(target, _prompts(4), drafter="ngram", gamma="auto", max_new_tokens=32)[3].token_ids)
             for _ in range(5)}
    assert len(texts) == 1


def test_seeded_sampling_is_bit_identical_across_drafters_and_gamma_in_bf16(tmp_path):
    target = _target()

    def run(drafter, gamma):
        outs = speculant.generate(target, _prompts(4), drafter=drafter, gamma=gamma, max_new_tokens=24,
                                  temperature=0.9, top_p=0.95, seed=[11, 12, 13, 14])
        return [o.token_ids for o in outs]

    plain = run("none", 1)
    for drafter in ("ngram", "ngram:tree", ModelDrafter(perturbed(target, 0.3, seed=14))):
        for gamma in (1, 4, "auto"):
            assert run(drafter, gamma) == plain, (drafter, gamma)
