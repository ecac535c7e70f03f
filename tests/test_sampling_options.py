"""Every sampling option is lossless under speculation.

Greedy: speculative output == plain output (drafter none) == a naive reference decoder that
re-runs the whole sequence each step and applies the option by hand (an independent
implementation of its semantics). Sampling: the chi-square test of test_engine_sampling against
the exact distribution by enumeration; a deliberately wrong variant (draft tokens not counted by
the frequency penalty at later block positions) must fail it.
"""
from collections import Counter

import pytest
import torch

import speculant
from speculant.drafters import ModelDrafter, NgramDrafter, NoDrafter
from speculant.sampling import Context, LogitsProcessing, SamplingParams, apply_penalties
from helpers import mismatch_report, perturbed, tiny_llama
from test_engine_sampling import PROMPT, V, exact_distribution, fit_pvalue, peaked, sample_counts


def skip_third(ids, logits):
    """A context-dependent mask: forbid tokens t with (t - last token) divisible by 3."""
    t = torch.arange(logits.shape[-1])
    return logits.masked_fill((t - ids[-1]) % 3 == 0, float("-inf"))


def naive_greedy(model, prompt, n, presence=0.0, frequency=0.0, rep=1.0, bias=None, processor=None):
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
        for t in set(prompt + out) if rep != 1.0 else ():
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t, c in Counter(out).items():
            logits[t] -= presence + frequency * c
        for t, b in (bias or {}).items():
            logits[t] += b
        if processor is not None:
            logits = processor(prompt + out, logits)
        out.append(int(logits.argmax()))
    return out


GREEDY_CASES = {
    "presence+frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "rep+frequency": dict(repetition_penalty=1.3, frequency_penalty=0.4),
    "logit_bias": dict(logit_bias={5: 2.0, 17: -100.0, 40: 1.5}),
    "processor": dict(logits_processors=[skip_third]),
}


def _naive_kwargs(opts):
    return dict(presence=opts.get("presence_penalty", 0.0), frequency=opts.get("frequency_penalty", 0.0),
                rep=opts.get("repetition_penalty", 1.0), bias=opts.get("logit_bias"),
                processor=(opts.get("logits_processors") or [None])[0])


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_option_speculative_equals_plain(case):
    opts = GREEDY_CASES[case]
    target = tiny_llama(4)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 11], [3, 50, 60, 70, 3, 50, 60]]
    new = 24
    plain = speculant.generate(target, prompts, drafter=NoDrafter(), max_new_tokens=new, **opts)
    unprocessed = speculant.generate(target, prompts, drafter=NoDrafter(), max_new_tokens=new)
    for p, a, u in zip(prompts, plain, unprocessed):
        assert a.token_ids != u.token_ids, f"{case} did not change the output: this case tests nothing"
        assert a.token_ids == naive_greedy(target, p, new, **_naive_kwargs(opts)), f"{case}: plain != naive reference"
    for kind, gamma in [("model", 3), ("model", "auto"), ("ngram", 3)]:
        drafter = ModelDrafter(perturbed(target, 0.2, seed=3)) if kind == "model" else NgramDrafter()
        spec = speculant.generate(target, prompts, drafter=drafter, gamma=gamma, max_new_tokens=new, **opts)
        for p, a, b in zip(prompts, plain, spec):
            assert b.token_ids == a.token_ids, f"{kind} γ={gamma}: " + mismatch_report(target, p, a.token_ids, b.token_ids)
        if kind == "model":  # (penalties stop the repetition n-gram lookup feeds on, so it may accept nothing)
            assert sum(o.stats["accepted_draft_tokens"] for o in spec) > 0, f"γ={gamma}: no draft accepted"


def test_penalty_formulas_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    ctx = Context(seen=torch.tensor([[True, True, False, False]]), counts=torch.tensor([[0, 2, 1, 0]]))
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, params, ctx)
    # rep: 2/2, -1*2 (seen); then presence + frequency*count on output tokens 1 (x2) and 2 (x1)
    assert torch.allclose(got, torch.tensor([[1.0, -2.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 3.0]]))
    bias = LogitsProcessing(SamplingParams(logit_bias={3: -10.0}), vocab_size=4).scores(logits)
    assert torch.allclose(bias, torch.tensor([[2.0, -1.0, 0.5, -7.0]]))


@pytest.mark.parametrize("bad,needle", [
    (dict(presence_penalty=float("nan")), "presence penalty"),
    (dict(frequency_penalty="x"), "frequency penalty"),
    (dict(logit_bias={-1: 1.0}), "logit bias"),
    (dict(logit_bias={3: float("inf")}), "logit bias"),
    (dict(logits_processors=[42]), "logits_processors"),
])
def test_bad_sampling_options_one_line(bad, needle):
    with pytest.raises(speculant.errors.SpeculantError) as e:
        SamplingParams(**bad)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_logit_bias_outside_vocabulary_is_an_error():
    with pytest.raises(speculant.errors.SpeculantError, match="outside the vocabulary"):
        speculant.generate(tiny_llama(0), [1, 2, 3], drafter="ngram", max_new_tokens=3, logit_bias={96: 1.0})


def mask_next(ids, logits):
    """4-token vocab: forbid (last token + 1) mod 4, so the mask depends on earlier drafts."""
    return logits.masked_fill(torch.arange(logits.shape[-1]) == (ids[-1] + 1) % V, float("-inf"))


SAMPLING_CASES = {
    "presence+frequency+bias": SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0,
                                              logit_bias={2: 1.0}),
    "min_p": SamplingParams(temperature=1.3, min_p=0.2),
    "processor": SamplingParams(temperature=1.0, logits_processors=(mask_next,)),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_option_matches_target_distribution(case):
    params = SAMPLING_CASES[case]
    target = peaked(0)
    exact = exact_distribution(target, params)
    assert (exact != exact_distribution(target, SamplingParams(temperature=params.temperature))).any()
    counts, alpha = sample_counts(target, ModelDrafter(peaked(1)), params, seed=4321)
    pvalue = fit_pvalue(counts, exact)
    assert pvalue > 1e-4, f"{case}: chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.05 < alpha < 0.95, f"acceptance {alpha:.2f}: too extreme to exercise both accept and reject"


def test_drafts_not_counted_by_frequency_penalty_fails(monkeypatch):
    """The classic mistake: penalise only the accepted text, not the drafts before a block position."""
    import speculant.sampling as sampling

    params = SAMPLING_CASES["presence+frequency+bias"]
    target = peaked(0)
    exact = exact_distribution(target, params)
    monkeypatch.setattr(sampling, "block_counts",
                        lambda c, bt, seen=None: c[:, None, :].expand(c.shape[0], bt.shape[1] + 1, c.shape[1]).clone())
    counts, _ = sample_counts(target, ModelDrafter(peaked(1)), params, seed=77)
    pvalue = fit_pvalue(counts, exact)
    assert pvalue < 1e-6, f"drafts left out of the penalty went unnoticed (p-value {pvalue:.2e})"


def _reference_logprobs(model, params, prompt, tokens):
    """log p of each output token under the processed target distribution, by full forward passes."""
    from speculant.sampling import TokenHistory

    x = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(x).logits[:, len(prompt) - 1 : -1]
    ctx = TokenHistory([prompt], logits.shape[-1], "cpu", params).block(torch.tensor([tokens[:-1]]))
    proc = LogitsProcessing(params)
    if params.greedy:
        return proc.scores(logits, ctx).log_softmax(-1)[0]
    return proc.probs(logits, ctx).log()[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_come_from_the_target_distribution(temperature):
    target = tiny_llama(5)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [3, 50, 60, 3, 50]]
    params = dict(temperature=temperature, top_k=20, frequency_penalty=0.3)
    drafter = ModelDrafter(perturbed(target, 0.2, seed=3))
    outs = speculant.generate(target, prompts, drafter=drafter, gamma=4, max_new_tokens=24, seed=3, logprobs=5, **params)
    for p, o in zip(prompts, outs):
        assert [e["token"] for e in o.logprobs] == o.token_ids
        ref = _reference_logprobs(target, SamplingParams(**params), p, o.token_ids)
        for t, e in enumerate(o.logprobs):
            assert e["logprob"] == pytest.approx(float(ref[t, e["token"]]), abs=1e-4)
            assert len(e["top"]) == 5 and e["top"][0][1] == pytest.approx(float(ref[t].max()), abs=1e-4)
    if temperature == 0:
        plain = speculant.generate(target, prompts, drafter=NoDrafter(), max_new_tokens=24, logprobs=5, **params)
        for a, b in zip(plain, outs):
            assert [e["token"] for e in a.logprobs] == [e["token"] for e in b.logprobs]
            assert all(x["top"][0][0] == x["token"] for x in b.logprobs)  # greedy takes the argmax
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0
    assert speculant.generate(target, prompts[0], max_new_tokens=3).logprobs is None


def test_stop_string_ending_inside_an_accepted_run(tmp_path):
    from helpers import save_tiny_folder
    from speculant.api import _stop_checker

    folder = save_tiny_folder(tmp_path / "tiny")
    spec = speculant.load(str(folder), drafter="ngram", gamma=6)
    plain = speculant.load(str(folder), drafter="none")
    prompt_ids = spec.encode("w7 w8 w9 w10 w7 w8 w9 w10 w7 w8", chat_template=False)
    runs = []  # the chunks speculative decoding emitted, one per target pass
    it = spec.stream_ids([prompt_ids], max_new_tokens=60)
    for _, added in it:
        runs.append(added)
    tokens = [t for r in runs for t in r]
    run_end = {sum(len(r) for r in runs[: i + 1]) - 1 for i in range(len(runs))}  # index of each run's last token
    stop = cut = None
    for j, n in ((j, n) for j in range(1, len(tokens)) for n in range(2, 7) if j not in run_end and j >= n - 1):
        cand = spec.decode(tokens[j - n + 1 : j + 1])
        if _stop_checker(spec.tokenizer, [cand])(tokens) == j + 1:  # first completed by token j, inside a run
            stop, cut = cand, j + 1
            break
    assert stop is not None, f"no multi-token accepted run to test with: {runs}"
    a = spec.generate_ids([prompt_ids], max_new_tokens=60, stop=[stop])[0]
    b = plain.generate_ids([prompt_ids], max_new_tokens=60, stop=[stop])[0]
    assert a.token_ids == b.token_ids == tokens[:cut]
    assert a.finish_reason == b.finish_reason == "stop"
    assert a.text == b.text == spec.decode(tokens[:cut])[: spec.decode(tokens[:cut]).find(stop)]


ROW_SETTINGS = [
    dict(),  # greedy
    dict(temperature=0.8, top_k=10),
    dict(temperature=1.2, top_p=0.9, min_p=0.05),
    dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 5.0}),
    dict(frequency_penalty=0.4, logprobs=3),  # greedy, with a penalty and logprobs
    dict(temperature=0.9, logprobs=2),
]


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("kind", ["ngram", "suffix", "model"])
def test_rows_with_other_settings_share_a_batch_and_keep_their_text(kind, path):
    """Greedy and sampled rows, other temperatures, top-k/p, min-p, penalties, biases and logprobs
    in ONE batch: each row's text (and logprobs) is what it gives alone with the same seed."""
    target = tiny_llama(0, layers=2)
    g = torch.Generator().manual_seed(5)
    loop = torch.randint(2, 96, (5,), generator=g).tolist()
    prompts = [loop * 3 if i % 2 else torch.randint(2, 96, (10,), generator=g).tolist() for i in range(6)]
    seeds = [None, 3, 4, 5, None, 6]

    def make():
        return {"ngram": NgramDrafter, "suffix": lambda: "suffix",
                "model": lambda: ModelDrafter(perturbed(target, 0.3, seed=4))}[kind]()

    together = speculant.generate(target, prompts, drafter=make(), gamma="auto", max_new_tokens=24, seed=seeds,
                                  path=path, row_sampling=ROW_SETTINGS)
    for p, s, settings, out in zip(prompts, seeds, ROW_SETTINGS, together):
        alone = speculant.generate(target, [p], drafter="none", max_new_tokens=24, seed=[s], path=path, **settings)[0]
        assert out.token_ids == alone.token_ids, f"{settings}: its text changed in a shared batch"
        if "logprobs" in settings:
            assert [e["token"] for e in out.logprobs] == out.token_ids
            for a, b in zip(out.logprobs, alone.logprobs):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4) and len(a["top"]) == settings["logprobs"]
        else:
            assert out.logprobs is None
    assert sum(o.stats["accepted_draft_tokens"] for o in together) > 0


def test_sampled_rows_beside_greedy_rows_keep_the_target_distribution():
    """Unseeded sampled rows (rejection sampling against the drafter's q) share the batch with
    greedy rows, whose drafts and checks are one-hot: the sampled rows still follow p exactly."""
    params = SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.3)
    target = peaked(0)
    n = 12_000
    settings = [params.__dict__ if r % 4 else {} for r in range(n)]  # every 4th row greedy
    torch.manual_seed(31)
    outs = speculant.generate(target, [PROMPT] * n, drafter=ModelDrafter(peaked(1)), gamma=3, max_new_tokens=4,
                              row_sampling=settings)
    sampled = [o.token_ids for r, o in enumerate(outs) if r % 4]
    codes = torch.tensor([sum(t * V ** (3 - i) for i, t in enumerate(s)) for s in sampled])
    counts = torch.bincount(codes, minlength=V**4).double()
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e}"
    greedy = speculant.generate(target, PROMPT, drafter="none", max_new_tokens=4).token_ids
    assert all(o.token_ids == greedy for r, o in enumerate(outs) if r % 4 == 0)


@pytest.mark.parametrize("path", ["general", "fast"])
def test_a_batch_with_other_settings_joins_a_running_one(path):
    """Continuous batching across settings: a seeded sampled batch joins a running greedy one and
    every row keeps its text; a batch whose processing reads other forms of the text (a repetition
    penalty needs the tokens seen) cannot join, with a one-line error."""
    from speculant.errors import SpeculantError
    from speculant.models import LoadedModel

    target = tiny_llama(0, layers=2)
    gen = speculant.Generator(LoadedModel(target, None, "tiny"), NgramDrafter(), gamma="auto", path=path)
    g = torch.Generator().manual_seed(9)
    prompts = [(torch.randint(2, 96, (4,), generator=g).tolist() * 4)[: 6 + 3 * i] for i in range(3)]
    sampled = dict(temperature=0.9, top_p=0.95)
    alone = [gen.generate_ids([prompts[0]], max_new_tokens=20)[0].token_ids,
             *(o.token_ids for o in gen.generate_ids(prompts[1:], max_new_tokens=20, seed=[8, 9], **sampled))]
    running = gen.start_batch(prompts[:1], [20], [[]])
    for _ in gen.engine.step(running):
        pass
    joiner = gen.start_batch(prompts[1:], [20, 20], [[], []], seed=[8, 9], **sampled)
    refused = gen.start_batch(prompts[1:2], [20], [[]], repetition_penalty=1.2)
    assert running.can_join(joiner) and not running.can_join(refused)
    with pytest.raises(SpeculantError, match="cannot join"):
        gen.engine.join(running, refused)
    gen.engine.finish(refused)
    gen.engine.join(running, joiner)
    while not running.done:
        for _ in gen.engine.step(running):
            pass
    rows = gen.engine.finish(running)
    assert [r.tokens for r in rows] == alone


def test_a_batch_keeps_the_forms_it_started_with_when_the_rows_that_needed_them_leave():
    """A batch whose penalised row has left still keeps output counts in its histories, so it
    refuses a batch that keeps none (before touching either), and goes on as before."""
    from speculant.models import LoadedModel

    target = tiny_llama(0, layers=2)
    gen = speculant.Generator(LoadedModel(target, None, "tiny"), ModelDrafter(perturbed(target, 0.3, seed=4)), gamma=3)
    prompts = [[5, 6, 7, 5, 6], [9, 8, 7, 9, 8]]
    settings = [dict(repetition_penalty=1.2, presence_penalty=0.5), dict(repetition_penalty=1.2)]
    alone = gen.generate_ids(prompts[1:], max_new_tokens=20, **settings[1])[0].token_ids
    running = gen.start_batch(prompts, [1, 20], [[], []], row_sampling=settings)
    for _ in gen.engine.step(running):
        pass
    assert len(running.active) == 1 and running.proc.forms == (True, True, False)
    other = gen.start_batch(prompts[1:], [20], [[]], **settings[1])
    assert not running.can_join(other)
    gen.engine.finish(other)
    while not running.done:
        for _ in gen.engine.step(running):
            pass
    assert gen.engine.finish(running)[1].tokens == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_takes_the_first_of_tied_maxima_as_tensor_argmax_does(dtype):
    """speculant's argmax (max's indices, faster on a CPU) must choose exactly what HF's argmax does,
    ties included: bf16 logits tie often, and a different tie-break would change greedy output."""
    from speculant.sampling import argmax

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 9, 4096, generator=g) * 2).round().to(dtype)  # integers: many tied maxima
    x[0, 0, 7] = x[0, 0, 3000] = x[0, 0].max() + 1  # a tie at the top, far apart
    tied = (x == x.max(-1, keepdim=True).values).sum(-1) > 1
    assert tied.float().mean() > 0.5
    assert torch.equal(argmax(x), x.argmax(-1))
    assert int(argmax(x)[0, 0]) == 7
