"""Invariant 1: greedy output is token-identical to Hugging Face generate(do_sample=False),
for every drafter, γ and batch size, on tiny random models (several seeds)."""
import pytest
import torch

import speculant
from speculant.drafters import ModelDrafter, NgramDrafter, NoDrafter
from helpers import each_pass, hf_greedy, mismatch_report, perturbed, tiny_llama

SEEDS = [0, 1, 2]


def _prompts(seed, n=4):
    g = torch.Generator().manual_seed(100 + seed)
    out = []
    for i in range(n):
        length = 3 + 5 * i
        base = torch.randint(1, 96, (length,), generator=g).tolist()
        if i % 2:  # repetitive prompts, so n-gram lookup finds matches
            base = (base[:4] * 8)[: length + 12]
        out.append(base)
    return out


def _drafter(kind, target, seed):
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    return ModelDrafter(perturbed(target, 0.3, seed=seed + 7))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", ["none", "ngram", "model"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("path", ["general", "fast"])
def test_greedy_identical_to_hf_generate(kind, gamma, batch, seed, path):
    target = tiny_llama(seed)
    prompts = _prompts(seed)[:batch] if batch > 1 else [_prompts(seed)[1]]
    max_new = 40
    refs = [hf_greedy(target, p, max_new) for p in prompts]
    outs = speculant.generate(target, prompts, drafter=_drafter(kind, target, seed), gamma=gamma,
                              max_new_tokens=max_new, path=path)
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    if kind != "none":
        total = sum(o.stats["accepted_draft_tokens"] for o in outs)
        assert total > 0, "the drafter never had a token accepted: this case tests nothing"


def test_eos_and_mixed_finish_in_a_batch():
    """Rows hit EOS at different passes; each stops at its own EOS, as HF does."""
    target = tiny_llama(3)
    prompts = _prompts(3)
    refs = [hf_greedy(target, p, 30) for p in prompts]
    eos = refs[1][5]  # a token row 1 produces early
    target.generation_config.eos_token_id = eos
    refs = [hf_greedy(target, p, 30) for p in prompts]
    outs = speculant.generate(target, prompts, drafter="ngram", gamma=4, max_new_tokens=30)
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert outs[1].finish_reason == "eos" and outs[1].token_ids[-1] == eos


def test_repetition_penalty_greedy_matches_hf():
    target = tiny_llama(4)
    prompts = _prompts(4)
    for p in prompts:
        x = torch.tensor([p])
        ref = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False,
                              repetition_penalty=1.3)[0, len(p):].tolist()
        for drafter in ["ngram", ModelDrafter(perturbed(target, 0.3))]:
            out = speculant.generate(target, p, drafter=drafter, gamma=4, max_new_tokens=30, repetition_penalty=1.3)
            assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)


@pytest.mark.parametrize("path,kind", [("general", "model"), ("fast", "model"), ("fast", "layerskip")])
def test_kv_caches_equal_a_fresh_prefill_after_rejections(path, kind):
    """Invariant 3: after each pass, the target's cache holds exactly the accepted text (layerskip on
    the fast path drafts inside the target's own cache: its slots must be overwritten)."""
    from speculant.drafters import LayerSkipDrafter

    target = tiny_llama(5, layers=3)
    drafter = ModelDrafter(perturbed(target, 0.5)) if kind == "model" else LayerSkipDrafter(target, [1])
    gen = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"), drafter, gamma=4, path=path)
    prompts = _prompts(5)
    checked = rejections = 0
    for batch, texts, got in each_pass(gen, prompts, 30):
        # a pass whose draft was cut short (fewer than γ + 1 tokens): not the prefill's one token, not the cap
        rejections += sum(len(prompts[r]) < len(texts[r]) - len(new) and len(new) < 5
                          and len(texts[r]) - len(prompts[r]) < 25 for r, new in got.items())
        state = batch.state
        for slot, r in enumerate(batch.active):
            accepted = texts[r][:-1]  # the newest token is fed at the next pass
            with torch.no_grad():
                fresh = target(torch.tensor([accepted]), use_cache=True).past_key_values
            for layer in range(2):
                k, v = state.valid_kv(slot, layer)
                fk, fv = fresh.layers[layer].keys[0], fresh.layers[layer].values[0]
                assert k.shape == fk.shape, (k.shape, fk.shape)
                torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v, fv, atol=1e-5, rtol=1e-4)
            checked += 1
    assert checked > 10 and rejections > 3
    assert kind != "layerskip" or drafter.shared


@pytest.mark.parametrize("path", ["general", "fast"])
def test_model_drafter_cache_rolls_back_to_accepted_text(path):
    from speculant.models.backend import Backend

    target = tiny_llama(6)
    draft_model = perturbed(target, 0.5)
    drafter = ModelDrafter(draft_model, backend=Backend(draft_model, path))
    from speculant.drafters import DraftContext
    from speculant.sampling import LogitsProcessing, SamplingParams

    prompts = _prompts(6)
    drafter.start(DraftContext(prompts, LogitsProcessing(SamplingParams()), None, torch.device("cpu"), 96))
    texts = [list(p) for p in prompts]
    drafter.update([[7], [8], [9], [10]], [0, 0, 0, 0])
    for t, first in zip(texts, [7, 8, 9, 10]):
        t.append(first)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        prop = drafter.propose(4)
        n = torch.randint(0, 5, (4,), generator=g).tolist()  # the target keeps a random prefix
        new = [prop.tokens[i, : n[i]].tolist() + [int(torch.randint(0, 96, (1,), generator=g))] for i in range(4)]
        drafter.update(new, n)
        for i in range(4):
            texts[i].extend(new[i])
            in_cache = texts[i][: len(texts[i]) - len(drafter.to_feed[i])]
            with torch.no_grad():
                fresh = draft_model(torch.tensor([in_cache]), use_cache=True).past_key_values
            k, v = drafter.state.valid_kv(i, 1)
            torch.testing.assert_close(k, fresh.layers[1].keys[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, fresh.layers[1].values[0], atol=1e-5, rtol=1e-4)


def test_ngram_proposes_full_periods_on_repetitive_text():
    from speculant.drafters.base import DraftContext
    from speculant.sampling import LogitsProcessing, SamplingParams

    d = NgramDrafter()
    d.start(DraftContext([[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7]], LogitsProcessing(SamplingParams()), None,
                         torch.device("cpu"), 96))
    prop = d.propose(7)
    assert prop.tokens[0].tolist() == [3, 1, 2, 3, 1, 2, 3]  # the period continues past the text's end
    assert prop.lengths.tolist() == [7, 0]  # nothing repeats in row 1: no proposal


@pytest.mark.parametrize("kind,batch", [("none", 1), ("ngram", 1), ("model", 4)])
def test_compiled_fast_path_greedy_identical_to_hf_generate(kind, batch):
    """``compile=True`` on CPU: the decoder layer runs as torch.compile'd C++ kernels; in float32 the
    greedy text still equals HF generate's (decode steps, verify blocks, the prefill, a batch)."""
    target = tiny_llama(4)
    prompts = _prompts(4)[:batch] if batch > 1 else [_prompts(4)[1]]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    gen = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"), _drafter(kind, target, 4),
                              gamma=3, path="fast", compile=True)
    assert gen.backend.name == "fast+compiled"
    outs = gen.generate_ids(prompts, max_new_tokens=30)
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
@pytest.mark.parametrize("kernels", ["auto", "aten"])
def test_fast_path_keeps_every_projection_bias(bias, kernels):
    """Llama configs with attention_bias (q/k/v/o biases) or mlp_bias (gate/up/down biases): the fast
    path uses every bias, packed or not (it once dropped o_proj's and the MLP's silently)."""
    torch.manual_seed(11)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, **{bias: True})
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)  # initialised to zero: make them matter
    prompt = _prompts(11)[1]
    ref = hf_greedy(target, prompt, 24)
    gen = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"), NgramDrafter(), gamma=3,
                              path="fast", kernels=None if kernels == "auto" else kernels)
    out = gen.generate_ids([prompt], max_new_tokens=24)[0]
    assert out.token_ids == ref, mismatch_report(target, prompt, ref, out.token_ids)


def test_device_map_loads_with_accelerate_and_a_split_model_runs_on_the_general_path(tmp_path):
    """--device-map auto (accelerate): on this CPU-only machine the whole model lands on the CPU; a
    model spread over several devices runs on the general path, whose outputs come back to the
    input's device. (Several GPUs are not available to the tests.)"""
    from helpers import save_tiny_folder
    from speculant.models.backend import Backend

    folder = save_tiny_folder(tmp_path / "tiny")
    gen = speculant.load(str(folder), drafter="ngram", dtype="float32", device_map="auto", gamma=3)
    ids = gen.tokenizer("w3 w7 w3 w7 w3 w7 w9")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=12)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 12)
    model = gen.target.model
    placed = getattr(model, "hf_device_map", None)  # newer transformers record no map for one device
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": 0, "lm_head": 1}  # as accelerate records
    try:
        assert Backend(model, "auto", quiet=True).name == "general"
    finally:
        if placed is None:
            del model.hf_device_map
        else:
            model.hf_device_map = placed


def _joining_drafter(kind, target, tmp_path):
    from speculant.drafters import SuffixDrafter

    if kind in ("eagle", "eagle+ngram"):
        from speculant.drafters.eagle import load_eagle
        from speculant.drafters.hybrid import HybridDrafter
        from test_eagle import _random_eagle_folder

        eagle = load_eagle(_random_eagle_folder(tmp_path, target, scale=0.3), target, "tiny")
        return eagle if kind == "eagle" else HybridDrafter(eagle)
    if kind == "dflash":
        from speculant.drafters.dflash import load_dflash
        from test_dflash import _random_drafter_folder

        return load_dflash(_random_drafter_folder(tmp_path, target), target, "tiny")
    if kind == "medusa":
        from speculant.drafters.medusa import load_medusa
        from test_medusa import _random_medusa_folder

        return load_medusa(_random_medusa_folder(tmp_path, target), target, "tiny")
    if kind in ("cross-tokenizer", "layerskip", "cascade-ngram", "cascade-model"):
        from test_drafters_extra import make

        return make(kind, target, 0)
    if kind in ("model", "model+ngram"):
        from speculant.drafters.model import LookupFirstDrafter, ModelDrafter

        drafter = ModelDrafter(perturbed(target, 0.02), label="tiny")
        return drafter if kind == "model" else LookupFirstDrafter(drafter)
    return {"none": NoDrafter, "ngram": NgramDrafter, "suffix": lambda: SuffixDrafter(share=False)}[kind]()


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("kind", ["none", "ngram", "suffix", "eagle", "dflash", "medusa", "eagle+ngram", "model",
                                  "model+ngram", "cross-tokenizer", "layerskip"])
def test_rows_joining_a_running_batch_decode_as_alone(tmp_path, path, kind):
    """Continuous batching: batches started later join a running one between passes (rows at
    different lengths, caches of different sizes, drafter and controller state carried over); every
    row's text is still the target's greedy text, and rows leave as they end."""
    from speculant.models import LoadedModel

    target = tiny_llama(0, layers=3)
    gen = speculant.Generator(LoadedModel(target, None, "tiny"), _joining_drafter(kind, target, tmp_path),
                              gamma="auto", path=path)
    if gen.join_refusal:  # layerskip on the fast path: the test below
        pytest.skip(gen.join_refusal)
    g = torch.Generator().manual_seed(7)
    prompts = [(torch.randint(1, 96, (4,), generator=g).tolist() * 6)[: 4 + 5 * i] for i in range(5)]
    limits = [24, 8, 20, 30, 12]
    engine = gen.engine
    running = gen.start_batch(prompts[:2], limits[:2], [[], []])
    got = {}
    for step, joining in enumerate([None, None, (2, 4), None, (4, 5)] + [None] * 60):
        if joining is not None:
            lo, hi = joining
            other = gen.start_batch(prompts[lo:hi], limits[lo:hi], [[]] * (hi - lo))
            assert running.can_join(other)
            engine.join(running, other)
        for r, new in engine.step(running):
            got.setdefault(r, []).extend(new)
        if running.done:
            break
    rows = engine.finish(running)
    assert len(rows) == 5 and all(r.finished for r in rows)
    for p, n, row in zip(prompts, limits, rows):
        ref = hf_greedy(target, p, n)
        assert row.tokens == ref, mismatch_report(target, p, ref, row.tokens)
    assert [got[r] for r in range(5)] == [row.tokens for row in rows]
    # every pooled cache went back: the target's, and a draft model's (joined states hold their own)
    drafter = getattr(gen.drafter, "model", gen.drafter)
    for backend in (engine.backend, getattr(drafter, "backend", None)):
        assert backend is None or not getattr(backend, "in_use", None), kind


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("kind", ["none", "ngram", "suffix", "eagle", "dflash", "medusa", "eagle+ngram", "model",
                                  "model+ngram", "cross-tokenizer", "layerskip", "cascade-ngram", "cascade-model"])
def test_every_drafter_joins_a_running_batch_or_says_why(tmp_path, path, kind):
    """A batch of every drafter takes rows of another between passes, or the generator says why
    not in one sentence (the server prints it as it starts): never a refusal nobody explains."""
    from speculant.models import LoadedModel

    target = tiny_llama(0, layers=3)
    gen = speculant.Generator(LoadedModel(target, None, "tiny"), _joining_drafter(kind, target, tmp_path),
                              gamma=2, path=path)
    running = gen.start_batch([[5, 6, 7]], [8], [[]])
    list(gen.engine.step(running))
    other = gen.start_batch([[8, 9]], [8], [[]])
    why = gen.join_refusal
    assert running.can_join(other) == (why is None), (kind, why)
    assert why is None or (why and "\n" not in why and len(why) < 200)
    for b in (running, other):
        gen.engine.finish(b)


def test_batched_prefill_gives_a_frozen_lm_head_a_contiguous_input():
    """A strided [B, 1, H] slice of the last positions makes torch's matmul run a frozen LM head
    as a bmm over B expanded copies of its weight (21 GB and minutes for Gemma 3 at batch 64):
    the prefill must hand the head a contiguous copy, and decode as before. (The fast path's batched
    prefill runs oneDNN-packed heads, which take strided input, only slower.)"""
    target = tiny_llama(3).requires_grad_(False)  # frozen, as `speculant train` holds its target
    seen = []
    hook = target.lm_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    prompts = _prompts(3)  # lengths 3, 8, 13, 18: a padded batch
    gen = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"), NoDrafter(), gamma=1,
                              path="general")
    got = gen.generate_ids(prompts, max_new_tokens=6)
    hook.remove()
    assert seen and all(seen), seen
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(target, prompt, 6)


def test_a_requests_time_leaves_out_the_backends_one_off_proof(monkeypatch):
    """The backend's first ``info()`` proves its kernels' width invariance (~0.3 s on a CPU, once a
    model): a one-off that must not count as the first request's time to its first token (the CLI's
    tok/s read ~45 where the model ran ~190). A clock that jumps 100 s inside that call."""
    import types

    from speculant import engine

    clock = [0.0]
    monkeypatch.setattr(engine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    target = tiny_llama(3)
    gen = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"), NoDrafter(), gamma=1)
    info = gen.backend.info

    def slow_info():
        clock[0] += 100.0
        return info()

    monkeypatch.setattr(gen.backend, "info", slow_info)
    out = gen.generate_ids([[1, 2, 3, 4]], max_new_tokens=4)[0]
    assert out.token_ids == hf_greedy(target, [1, 2, 3, 4], 4)
    assert out.stats["first_token_seconds"] < 100.0 and out.stats["seconds"] < 100.0, out.stats
