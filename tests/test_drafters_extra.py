"""The layerskip, cascade and cross-tokenizer drafters through the same verifier as the others:
greedy output token-identical to HF generate, sampling distribution exact (chi-square), and
checks that each drafter really drafts well when it should (a cache or boundary bug shows up as
lost acceptance even though the output stays right)."""
import copy

import pytest
import torch

import speculant
from speculant.drafters import CascadeDrafter, CrossTokenizerDrafter, LayerSkipDrafter, ModelDrafter, NgramDrafter
from speculant.drafters.base import Drafter, Proposal
from speculant.drafters.layerskip import SkipLayersModel
from speculant.models.kv import KVState
from helpers import hf_greedy, mismatch_report, perturbed, tiny_llama
from test_engine_greedy import _prompts
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts

KINDS = ["layerskip", "cascade-ngram", "cascade-model", "cross-tokenizer"]


def quiet_middle(model, scale=0.2):
    """Damp layer 1's writes to the residual stream: skipping it then changes the output only
    sometimes, as for a trained model's less critical middle layers (random ones differ wildly)."""
    with torch.no_grad():
        layer = model.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)
    return model


def tiny_target(seed):
    return quiet_middle(tiny_llama(seed, layers=3))


# ---- tokenizers for the cross-tokenizer drafter: the same words, different ids ----

def word_tokenizer(words: list[str]):
    """A word-level tokenizer; ``words[i]`` gets id i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def target_words(vocab):
    return ["<unk>", "</s>"] + [f"w{i}" for i in range(2, vocab)]


def permuted_drafter(target, words, noise, seed, extra_words=4):
    """A drafter with a different vocabulary: the target's words shuffled to new ids plus a few
    words the target does not know, its embeddings and LM head rows moved to match (+ noise)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(words), generator=g).tolist()  # draft id d holds target word order[d]
    d_words = [words[i] for i in order] + [f"extra{i}" for i in range(extra_words)]
    base = perturbed(target, noise, seed=seed) if noise else copy.deepcopy(target)
    cfg = copy.deepcopy(base.config)
    cfg.vocab_size = len(d_words)
    draft = type(base)(cfg).eval()
    state = base.state_dict()
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor[: len(words)] = state[name][order]
                tensor[len(words) :] = state[name][:extra_words] * 0.1
            else:
                tensor.copy_(state[name])
    return draft, word_tokenizer(d_words)


def make(kind, target, seed, noise=0.3):
    if kind == "layerskip":
        return LayerSkipDrafter(target, [1])
    if kind == "cascade-ngram":
        return CascadeDrafter(NgramDrafter(), perturbed(target, noise, seed=seed + 7))
    if kind == "cascade-model":
        return CascadeDrafter(ModelDrafter(perturbed(target, 2 * noise, seed=seed + 9)), perturbed(target, noise, seed=seed + 7))
    if kind == "cross-tokenizer":
        vocab = target.config.vocab_size
        draft, dtok = permuted_drafter(target, target_words(vocab), noise / 2, seed + 7)
        return CrossTokenizerDrafter(draft, dtok, word_tokenizer(target_words(vocab)), label="permuted")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch,gamma,seed", [(1, 3, 0), (4, 1, 0), (4, 6, 0), (4, 6, 1)])
def test_greedy_identical_to_hf_generate(kind, gamma, batch, seed):
    target = tiny_target(seed)
    prompts = _prompts(seed)[:batch] if batch > 1 else [_prompts(seed)[1]]
    max_new = 40
    refs = [hf_greedy(target, p, max_new) for p in prompts]
    outs = speculant.generate(target, prompts, drafter=make(kind, target, seed), gamma=gamma, max_new_tokens=max_new)
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    total = sum(o.stats["accepted_draft_tokens"] for o in outs)
    assert total > 0, "the drafter never had a token accepted: this case tests nothing"


@pytest.mark.parametrize("batch,gamma,seed", [(1, 3, 0), (4, 6, 0), (4, 2, 1)])
def test_layerskip_sharing_the_target_cache_is_greedy_identical(batch, gamma, seed):
    """On the fast path layerskip drafts inside the target's static cache (its K/V of the accepted
    text, no cache of its own)."""
    target = tiny_target(seed)
    prompts = _prompts(seed)[:batch] if batch > 1 else [_prompts(seed)[1]]
    refs = [hf_greedy(target, p, 40) for p in prompts]
    drafter = LayerSkipDrafter(target, [1])
    outs = speculant.generate(target, prompts, drafter=drafter, gamma=gamma, max_new_tokens=40, path="fast")
    assert drafter.shared
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0


def test_the_general_path_passes_the_cache_by_the_keyword_transformers_takes(recwarn):
    """transformers 5.2x renamed forward's past_key_values to cache (the old name warns, then goes);
    5.17 and older know only past_key_values: the target's and layerskip's calls use what each takes."""
    target = tiny_target(0)
    prompt = _prompts(0)[1]
    out = speculant.generate(target, [prompt], drafter=LayerSkipDrafter(target, [1]), gamma=3, max_new_tokens=12,
                             path="general")[0]
    assert out.token_ids == hf_greedy(target, prompt, 12)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


def test_layerskip_sharing_the_cache_with_no_layer_skipped_is_the_target():
    """Skipping nothing, the shared-cache drafter is the target reading its own cache: every draft
    token must be accepted (a wrong position, a stale slot or a missed rollback would lose some)."""
    target = tiny_target(2)
    drafter = LayerSkipDrafter(target, [])
    prompts = _prompts(2)[:3]
    outs = speculant.generate(target, prompts, drafter=drafter, gamma=5, max_new_tokens=30, path="fast")
    assert drafter.shared
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target, p, 30)
        assert o.stats["acceptance_rate"] > 0.99, o.stats


def test_greedy_with_repetition_penalty():
    target = tiny_target(4)
    for p in _prompts(4)[1:2]:
        x = torch.tensor([p])
        ref = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                              repetition_penalty=1.3)[0, len(p):].tolist()
        for kind in KINDS:
            out = speculant.generate(target, p, drafter=make(kind, target, 4), gamma=4, max_new_tokens=20,
                                     repetition_penalty=1.3)
            assert out.token_ids == ref, f"{kind}: " + mismatch_report(target, p, ref, out.token_ids)


@pytest.mark.parametrize("kind", ["layerskip", "cascade-ngram", "cascade-model", "cross-tokenizer"])
def test_a_perfect_drafter_is_always_accepted(kind):
    """With the target itself as drafter (no layer skipped / middle = target / same model under other
    ids) every draft must pass: a drafter whose cache or text boundary went wrong would lose some."""
    target = tiny_target(2)
    if kind == "layerskip":
        drafter = LayerSkipDrafter(target, [])
    elif kind.startswith("cascade"):
        inner = NgramDrafter() if kind == "cascade-ngram" else ModelDrafter(perturbed(target, 0.3))
        drafter = CascadeDrafter(inner, copy.deepcopy(target))
    else:
        draft, dtok = permuted_drafter(target, target_words(96), 0.0, 3)
        drafter = CrossTokenizerDrafter(draft, dtok, word_tokenizer(target_words(96)))
    prompts = _prompts(2)[1:3]
    outs = speculant.generate(target, prompts, drafter=drafter, gamma=5, max_new_tokens=30)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target, p, 30)
        assert o.stats["acceptance_rate"] > (0.99 if kind != "cross-tokenizer" else 0.8), (kind, o.stats)


def test_skip_layers_model_without_skips_is_the_target():
    """The partial forward (own mask, own layer loop) equals the target's forward, holes in the cache included."""
    target = tiny_llama(0, layers=3)
    wrapper = SkipLayersModel(target, [])
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    state = KVState(wrapper, 2)
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[0, :3] = False  # row 0 is left-padded
    got = torch.cat([state.append(x[:, :5], valid[:, :5]), state.append(x[:, 5:])], 1)
    with torch.no_grad():
        torch.testing.assert_close(got[1], target(x[1:]).logits[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got[0, 3:], target(x[:1, 3:]).logits[0], atol=1e-5, rtol=1e-4)
    last = KVState(wrapper, 2).append(x[:, :5], valid[:, :5], last_only=True)  # the prefill's one position
    assert last.shape == (2, 1, 96)
    torch.testing.assert_close(last[:, 0], got[:, 4], atol=1e-5, rtol=1e-4)


def test_layerskip_specs():
    from speculant.drafters.layerskip import parse_skip_spec
    from speculant.errors import SpeculantError

    assert parse_skip_spec("layerskip:6-12:2", 30)[0] == [6, 8, 10, 12]
    assert parse_skip_spec("layerskip:3,5", 30)[0] == [3, 5]
    assert parse_skip_spec("layerskip", 30)[1] == "default"
    for bad in ("layerskip:0-3", "layerskip:5-40", "layerskip:x", "layerskip:nope.json"):
        with pytest.raises(SpeculantError):
            parse_skip_spec(bad, 30)


# ---- sampling: the target's exact distribution ----

def sampling_setup(kind, seed=0):
    """(target, drafter) on the 4-token vocabulary of the distribution test."""
    if kind == "layerskip":
        target = _peaked_layers(0, 3)
        return target, LayerSkipDrafter(target, [1])
    target = peaked(0)
    if kind == "cascade-ngram":
        return target, CascadeDrafter(NgramDrafter(), peaked(1))
    if kind == "cascade-model":
        return target, CascadeDrafter(ModelDrafter(peaked(2)), peaked(1))
    words = ["a", "b", "c", "d"]
    draft, dtok = permuted_drafter(peaked(1), words, 0.0, seed, extra_words=2)
    return target, CrossTokenizerDrafter(draft, dtok, word_tokenizer(words))


def _peaked_layers(seed, layers):
    m = quiet_middle(tiny_llama(seed, vocab=4, hidden=32, layers=layers), 0.5)
    with torch.no_grad():
        m.lm_head.weight.mul_(60)
    return m


@pytest.mark.parametrize("kind,params_name", [
    ("layerskip", "t=0.8,top_k=3,rep=1.3"),
    ("cascade-ngram", "temperature=1"),
    ("cascade-model", "t=0.8,top_k=3,rep=1.3"),
    ("cross-tokenizer", "temperature=1"),
])
def test_sampling_matches_target_distribution(kind, params_name):
    params = PARAMS[params_name]
    target, drafter = sampling_setup(kind)
    counts, alpha = sample_counts(target, drafter, params, seed=1234)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"{kind} {params_name}: chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.05 < alpha < 0.95, f"acceptance {alpha:.2f}: too extreme to exercise both accept and reject"


def test_layerskip_sharing_the_cache_samples_the_target_distribution():
    params = PARAMS["t=0.8,top_k=3,rep=1.3"]
    target, drafter = sampling_setup("layerskip")
    counts, alpha = sample_counts(target, drafter, params, seed=4321, path="fast")
    assert drafter.shared
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.05 < alpha < 0.95, f"acceptance {alpha:.2f}: too extreme to exercise both accept and reject"


class LateQ(Drafter):
    """The classic off-by-one: hands the verifier q of the previous position."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def start(self, ctx):
        self.inner.start(ctx)

    def propose(self, gamma):
        prop = self.inner.propose(gamma)
        q = prop.probs.clone()
        q[:, 1:] = prop.probs[:, :-1]
        return Proposal(prop.tokens, prop.lengths, q)

    def update(self, new_tokens, n_accepted):
        self.inner.update(new_tokens, n_accepted)

    def select(self, rows):
        self.inner.select(rows)


@pytest.mark.parametrize("wrong", ["cascade q one position late", "cross-tokenizer wrong residual"])
def test_a_wrong_formula_fails_the_distribution_test(wrong, monkeypatch):
    params = PARAMS["temperature=1"]
    if wrong.startswith("cascade"):
        target, drafter = sampling_setup("cascade-ngram")
        drafter = LateQ(drafter)
    else:
        import speculant.verify as verify

        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
        target, drafter = sampling_setup("cross-tokenizer")
    counts, _ = sample_counts(target, drafter, params, seed=99)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue < 1e-6, f"{wrong} went unnoticed (p-value {pvalue:.2e})"


# ---- the real default target ----

@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Write a haiku about the sea.",
                                    "def fibonacci(n):"])
def test_layerskip_on_the_default_model_is_greedy_identical(default_model, prompt):
    from speculant.drafters import make_drafter

    gen = speculant.Generator(default_model, make_drafter("layerskip", default_model), gamma=4)
    ids = gen.encode(prompt)
    out = gen.generate_ids([ids], max_new_tokens=24)[0]
    ref = hf_greedy(default_model.model, ids, 24)
    assert out.token_ids == ref, mismatch_report(default_model.model, ids, ref, out.token_ids)
    assert out.stats["accepted_draft_tokens"] > 0


def test_ngram_grades_its_draft_by_the_matched_ngram_length():
    import types

    from speculant.drafters.ngram import NgramDrafter

    d = NgramDrafter()
    d.start(types.SimpleNamespace(device=torch.device("cpu"), prompts=[[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5], [8, 9]]))
    prop = d.propose(3)
    assert prop.lengths.tolist() == [3, 3, 0] and prop.grades == [3, 1, 0]
    assert prop.tokens[0].tolist() == [4, 1, 2] and prop.tokens[1].tolist() == [6, 7, 5]
