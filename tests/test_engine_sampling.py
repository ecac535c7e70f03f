"""Invariant 2: speculative sampling gives exactly the target's distribution (Monte Carlo, chi-square).

A tiny 4-token model generates 4-token continuations (256 outcomes). The exact distribution of the
target under the same processing is computed by enumeration; plain sampling (drafter none) and
speculative sampling (model and n-gram drafters) must both fit it. A deliberately wrong residual
(sampling the correction from p instead of norm(max(0, p - q))) must fail the same test: that is
the proof the test has the power to catch a wrong formula.
"""
import itertools

import pytest
import torch
from scipy.stats import chi2

import speculant
from speculant.drafters import ModelDrafter, NgramDrafter, NoDrafter
from speculant.sampling import LogitsProcessing, SamplingParams, TokenHistory
from helpers import tiny_llama

V, NEW, N = 4, 4, 24_000
PROMPT = [0, 1, 2, 0, 1, 3, 0, 1]


def peaked(seed):
    m = tiny_llama(seed, vocab=V, hidden=32)
    with torch.no_grad():
        m.lm_head.weight.mul_(60)  # random tiny models are near-uniform: make p and q differ
    return m


def exact_distribution(model, params):
    seqs = torch.tensor(list(itertools.product(range(V), repeat=NEW)))
    x = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(x).logits[:, len(PROMPT) - 1 : -1]
    history = TokenHistory([PROMPT] * len(seqs), V, "cpu", params)
    context = history.block(seqs[:, :-1])  # position t has seen the prompt and seqs[:, :t]
    probs = LogitsProcessing(params).probs(logits, context)
    return probs.gather(2, seqs[..., None]).squeeze(2).prod(1).double()


def sample_counts(target, drafter, params, seed, path="auto", seeded=False, rows=N, gamma=3):
    """Counts of ``rows`` sampled continuations. By default unseeded rows (rejection sampling against
    the drafter's q), repeatable through torch's global seed; ``seeded``: every row seeded (each
    draws from its own noise, see SeededRows)."""
    if not seeded:
        torch.manual_seed(seed)
    outs = speculant.generate(target, [PROMPT] * rows, drafter=drafter, gamma=gamma, max_new_tokens=NEW,
                              seed=seed if seeded else None, path=path, **params.__dict__)
    codes = torch.tensor([sum(t * V ** (NEW - 1 - i) for i, t in enumerate(o.token_ids)) for o in outs])
    accepted = sum(o.stats["accepted_draft_tokens"] for o in outs)
    drafted = sum(o.stats["draft_tokens"] for o in outs)
    return torch.bincount(codes, minlength=V**NEW).double(), accepted / max(drafted, 1)


def fit_pvalue(counts, expected_probs):
    if counts[expected_probs == 0].sum() > 0:
        return 0.0  # an impossible continuation was sampled
    counts, expected_probs = counts[expected_probs > 0], expected_probs[expected_probs > 0]
    expected = expected_probs / expected_probs.sum() * counts.sum()
    big = expected >= 5
    if big.all():
        return _chi_square_pvalue(counts, expected)
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return _chi_square_pvalue(obs, exp)


def _chi_square_pvalue(observed, expected):
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(observed) - 1))


PARAMS = {
    "temperature=1": SamplingParams(temperature=1.0),
    "t=0.8,top_k=3,rep=1.3": SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.3),
    "t=1.2,top_p=0.9,min_p=0.05": SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("kind", ["none", "model", "ngram", "model+ngram"])
def test_sampling_matches_target_distribution(kind, params_name):
    """``model`` stops a row's draft after a token it gives less than its min_confidence (on here);
    ``model+ngram`` takes the lookup's chain (q one-hot) where it matches strongly."""
    from speculant.drafters.model import LookupFirstDrafter

    params = PARAMS[params_name]
    target = peaked(0)
    drafter = {"none": NoDrafter, "ngram": NgramDrafter, "model": lambda: ModelDrafter(peaked(1)),
               "model+ngram": lambda: LookupFirstDrafter(ModelDrafter(peaked(1)))}[kind]()
    counts, alpha = sample_counts(target, drafter, params, seed=1234)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"{kind} {params_name}: chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    if kind != "none":
        assert 0.05 < alpha < 0.95, f"acceptance {alpha:.2f}: too extreme to exercise both accept and reject"


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_a_wrong_residual_fails_the_distribution_test(kind, monkeypatch):
    import speculant.verify as verify

    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)  # the classic mistake
    params = PARAMS["temperature=1"]
    target = peaked(0)
    drafter = ModelDrafter(peaked(1)) if kind == "model" else NgramDrafter()
    counts, _ = sample_counts(target, drafter, params, seed=99)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue < 1e-6, f"a wrong residual went unnoticed (p-value {pvalue:.2e})"


@pytest.mark.parametrize("kind", ["none", "model", "ngram"])
def test_seeded_rows_match_target_distribution(kind):
    """Seeded rows choose by a race of their own noise: still exactly the target's distribution
    (over seeds), with a drafter that drafts from the same noise (model) or deterministically (ngram)."""
    params = PARAMS["t=0.8,top_k=3,rep=1.3"]
    target = peaked(0)
    drafter = {"none": NoDrafter(), "ngram": NgramDrafter(), "model": ModelDrafter(peaked(1))}[kind]
    counts, alpha = sample_counts(target, drafter, params, seed=2024, seeded=True, rows=12_000)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"{kind}: chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    if kind != "none":
        assert 0.05 < alpha < 0.95, f"acceptance {alpha:.2f}: too extreme to exercise both accept and reject"


def test_seeded_rows_with_the_wrong_noise_fail_the_distribution_test(monkeypatch):
    """Uniform noise in place of exponential noise in the race (argmax p/u instead of argmax p/E)
    samples the wrong distribution: the seeded test must catch it."""
    from speculant.sampling import SeededRows

    exp_noise = SeededRows._exp_noise
    monkeypatch.setattr(SeededRows, "_exp_noise", lambda self, *a: torch.exp(-exp_noise(self, *a)))
    params = PARAMS["temperature=1"]
    target = peaked(0)
    counts, _ = sample_counts(target, ModelDrafter(peaked(1)), params, seed=7, seeded=True, rows=12_000)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue < 1e-6, f"the wrong noise went unnoticed (p-value {pvalue:.2e})"


def test_any_integer_seeds_a_request():
    target = peaked(0)
    runs = [speculant.generate(target, PROMPT, drafter="ngram", max_new_tokens=8, seed=s, temperature=1.0).token_ids
            for s in (2**70, 2**70, -3)]
    assert runs[0] == runs[1] and len(runs[2]) == 8


def test_same_seed_same_output_different_seed_differs():
    target = peaked(0)
    a = speculant.generate(target, PROMPT, drafter=ModelDrafter(peaked(1)), gamma=4, max_new_tokens=20, seed=5, temperature=1.0)
    b = speculant.generate(target, PROMPT, drafter=ModelDrafter(peaked(1)), gamma=4, max_new_tokens=20, seed=5, temperature=1.0)
    outs = {tuple(speculant.generate(target, PROMPT, drafter="ngram", max_new_tokens=20, seed=s, temperature=1.0).token_ids)
            for s in range(6)}
    assert a.token_ids == b.token_ids
    assert len(outs) > 1


def _invariance_setup():
    target = tiny_llama(0, layers=2)
    g = torch.Generator().manual_seed(3)
    loop = torch.randint(2, 96, (5,), generator=g).tolist()
    prompts = [loop * 3] + [torch.randint(2, 96, (12,), generator=g).tolist() for _ in range(3)]
    return target, prompts


@pytest.mark.parametrize("path", ["general", "fast"])
def test_a_seeded_row_is_the_same_whatever_drafter_gamma_or_batch(path):
    """A seeded row's text is a function of its prompt, settings and seed alone: plain decoding,
    chain and tree drafters at any γ, alone or beside seeded and unseeded rows, all give it."""
    from helpers import perturbed

    target, prompts = _invariance_setup()
    params = dict(temperature=0.9, top_k=20, repetition_penalty=1.1)
    alone = speculant.generate(target, [prompts[0]], drafter="none", max_new_tokens=30, seed=[11], path=path,
                               **params)[0].token_ids
    drafters = {"ngram": NgramDrafter, "suffix (tree)": lambda: "suffix",
                "model": lambda: ModelDrafter(perturbed(target, 0.3, seed=4))}
    accepted = 0
    for name, make in drafters.items():
        for gamma in (1, 4, "auto"):
            outs = speculant.generate(target, prompts, drafter=make(), gamma=gamma, max_new_tokens=30,
                                      seed=[11, None, 5, None], path=path, **params)
            assert outs[0].token_ids == alone, f"{name}, γ {gamma}: the seeded row's text changed"
            accepted += outs[0].stats["accepted_draft_tokens"]
    assert accepted > 0  # drafts were accepted on the way, not just rejected
    again = speculant.generate(target, prompts[2:3] + prompts[:1], max_new_tokens=30, seed=[5, 11], path=path,
                               drafter=NgramDrafter(), **params)
    assert again[1].token_ids == alone  # another row position, other companions
    other = speculant.generate(target, [prompts[0]], drafter="none", max_new_tokens=30, seed=[12], path=path, **params)
    assert other[0].token_ids != alone
