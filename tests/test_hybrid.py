"""X+ngram: a tree drafter's tree and prompt lookup merged into one tree, exactly."""
import pytest
import torch

import speculant
from speculant.drafters import make_drafter, validate_drafter_spec
from speculant.drafters.eagle import load_eagle
from speculant.drafters.hybrid import HybridDrafter, merge_trees
from speculant.errors import SpeculantError
from helpers import hf_greedy, mismatch_report, tiny_llama
from test_eagle import _random_eagle_folder
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts


def _paths(tokens, parents):
    out = []
    for tok, par in zip(tokens, parents):
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


def test_merge_keeps_each_path_once_best_first_within_the_budget():
    # tree: 5 (0.6) -> 7 (0.3); 9 (0.2). lookup chain 5 8 4 at α̂ 0.5: 5 (0.5), 5 8 (0.25), 5 8 4 (0.125)
    tree = ([5, 7, 9], [-1, 0, -1], [0.6, 0.3, 0.2])
    tokens, parents, scores = merge_trees(tree, [5, 8, 4], 0.5, budget=10)
    paths = _paths(tokens, parents)
    assert dict(zip(paths, scores)) == {(5,): 0.6, (5, 7): 0.3, (5, 8): 0.25, (9,): 0.2, (5, 8, 4): 0.125}
    assert scores == sorted(scores, reverse=True) and all(p < i for i, p in enumerate(parents))
    small = merge_trees(tree, [5, 8, 4], 0.5, budget=3)
    assert _paths(*small[:2]) == [(5,), (5, 7), (5, 8)]
    sure = merge_trees(tree, [5, 8, 4], 0.95, budget=4)  # a lookup the text has been confirming comes first
    assert _paths(*sure[:2]) == [(5,), (5, 8), (5, 8, 4), (5, 7)]
    assert merge_trees(([], [], []), [], 0.5, budget=4) == ([], [], [])


def _prompts(batch):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(2, 96, (4,), generator=g).tolist() * 6)[: 5 + 3 * i] for i in range(batch)]


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("batch,gamma", [(1, 6), (4, "auto"), (4, 12)])
def test_greedy_identical_to_hf_generate(tmp_path, path, batch, gamma):
    target = tiny_llama(0, layers=2)
    drafter = HybridDrafter(load_eagle(_random_eagle_folder(tmp_path, target, scale=0.3), target, "tiny"))
    prompts = _prompts(batch)
    outs = speculant.generate(target, prompts, drafter=drafter, gamma=gamma, max_new_tokens=30, path=path)
    for p, out in zip(prompts, outs):
        ref = hf_greedy(target, p, 30)
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0
    assert outs[0].stats["drafter"].endswith("+ngram")


def test_sampling_matches_the_target_distribution(tmp_path):
    target = peaked(0)
    drafter = HybridDrafter(load_eagle(_random_eagle_folder(tmp_path, target, scale=0.0), target, "tiny"))
    params = PARAMS["t=0.8,top_k=3,rep=1.3"]
    counts, alpha = sample_counts(target, drafter, params, seed=17)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.02 < alpha < 0.98, alpha


@pytest.mark.parametrize("spec", ["ngram+ngram", "dflash+ngram", "cascade:ngram,model:x+ngram"])
def test_a_chain_drafter_before_plus_ngram_is_refused_in_one_line(spec):
    with pytest.raises(SpeculantError, match="must draft token trees"):
        validate_drafter_spec(spec)


def test_a_draft_model_plus_ngram_takes_the_lookup_where_it_matches_strongly():
    """model:PATH+ngram: a draft model behind the lookup, a chain drafter (not a tree); its texts are
    plain decoding's (test_invariance, test_gguf_direct) and its samples the target's (test_engine_sampling)."""
    from speculant.drafters.model import LookupFirstDrafter
    from speculant.models import LoadedModel
    from helpers import save_tiny_folder

    target = tiny_llama(0, layers=2)
    folder = save_tiny_folder(__import__("tempfile").mkdtemp(), layers=1, seed=3)
    drafter = make_drafter(f"model:{folder}+ngram", LoadedModel(target, None, "tiny"))
    assert isinstance(drafter, LookupFirstDrafter) and not drafter.makes_trees
    assert drafter.describe().endswith("+ngram")


def test_specs_build_the_hybrid(tmp_path):
    from speculant.models import LoadedModel

    target = tiny_llama(0, layers=2)
    folder = _random_eagle_folder(tmp_path, target)
    validate_drafter_spec(f"eagle:{folder}+ngram")
    drafter = make_drafter(f"eagle:{folder}+ngram", LoadedModel(target, None, "tiny"))
    assert isinstance(drafter, HybridDrafter) and drafter.describe() == f"eagle:{folder}+ngram"
    with pytest.raises(SpeculantError, match="unknown drafter"):
        validate_drafter_spec("hawk+ngram")


def test_export_gives_vllm_the_tree_drafter_alone(tmp_path):
    from pathlib import Path

    from speculant.export import vllm_config

    folder = _random_eagle_folder(tmp_path, tiny_llama(0, layers=2))
    cfg = vllm_config(f"eagle:{folder}+ngram")
    assert cfg == vllm_config(f"eagle:{folder}") and cfg["model"] == str(Path(folder).resolve())


@pytest.mark.usefixtures("float32_drafts")
def test_a_strong_lookup_chain_spares_the_heads_deeper_forwards(tmp_path, monkeypatch):
    """The chain's nodes count among the best γ while the head deepens its tree: with a chain the
    text keeps confirming, the head stops after fewer forwards, and the merged tree is the one the
    full-depth head would have given."""
    import speculant.drafters.eagle as eagle
    from test_eagle import _drafter_after

    monkeypatch.setattr(eagle, "MIN_SCORE", 0.0)  # a random head: deepen however unlikely its nodes
    target = tiny_llama(0, layers=2)
    folder = _random_eagle_folder(tmp_path, target, scale=0.3)
    ids = _prompts(1)[0]
    G = 12
    chain = list(range(80, 80 + G))  # tokens the random head's tree does not hold (checked below)

    def tree_and_forwards(rivals):
        drafter = _drafter_after(load_eagle(folder, target, "tiny"), target, ids, 7)
        forwards = []
        step = drafter.net.step
        monkeypatch.setattr(drafter.net, "step", lambda *a: forwards.append(1) or step(*a))
        prop = drafter.propose_among(G, rivals)
        n = int(prop.lengths[0])
        return (prop.tokens[0, :n].tolist(), prop.parents[0, :n].tolist(), prop.scores[0, :n].float().tolist()), len(forwards)

    alone, deep = tree_and_forwards(torch.zeros(1, 0))
    assert not set(chain) & set(alone[0])
    for alpha in (0.5, 0.99):  # a chain that shares the merged tree with the head's nodes, one that fills it
        among, shallow = tree_and_forwards(torch.tensor([[alpha ** d for d in range(1, G + 1)]]))
        assert shallow < deep, (alpha, deep, shallow)  # forwards: the catch-up, then one a depth
        merged = merge_trees(among, chain, alpha, G)
        assert merged == merge_trees(alone, chain, alpha, G)
        head_nodes = sum(t not in chain for t in merged[0])
        assert (0 < head_nodes < G) if alpha == 0.5 else head_nodes == 0, (alpha, merged)
    weak = torch.tensor([[0.01 ** d for d in range(1, G + 1)]])  # a chain the text refutes changes nothing
    assert tree_and_forwards(weak) == (alone, deep)


def test_lookup_chains_are_scored_by_what_their_grade_has_been_accepted():
    """A lookup chain's nodes score α̂^depth with α̂ kept per grade (matched n-gram length): after
    1-token matches kept failing and 3-token ones held, a 3-token match's chain outscores a 1-token
    match's in the same row."""
    import types

    from speculant.drafters.base import Drafter, tree_proposal

    class NoTree(Drafter):  # a tree drafter that proposes nothing: the merged tree is the lookup chain
        makes_trees = True

        def start(self, ctx):
            self.rows = len(ctx.prompts)

        def propose_among(self, gamma, rivals):
            return tree_proposal([([], [], [])] * self.rows, torch.device("cpu"))

        def propose(self, gamma):
            return self.propose_among(gamma, None)

        def update(self, new_tokens, n_accepted):
            pass

    d = HybridDrafter(NoTree())
    d.start(types.SimpleNamespace(device=torch.device("cpu"), prompts=[[1, 2, 3, 9, 7, 1, 2, 3]]))
    strong = d.propose(4)  # matches (1, 2, 3): chain 9, 7, 1, 2
    assert d.last_chain[0] == ([9, 7, 1, 2], 3)
    for _ in range(3):
        d.last_chain = [([5, 6], 1)]
        d.update([[4]], [0])  # a 1-gram chain refuted
        d.last_chain = [([9, 7], 3)]
        d.update([[9, 7, 8]], [2])  # a 3-gram chain followed
    weak_alpha = d.lookup_alpha[0][1][0] / d.lookup_alpha[0][1][1]
    strong_alpha = d.lookup_alpha[0][3][0] / d.lookup_alpha[0][3][1]
    assert weak_alpha < 0.3 < 0.8 < strong_alpha
    d.lookup.texts[0], d.lookup.index[0] = [], {}
    d.lookup._extend(0, [1, 2, 3, 9, 5, 1, 2, 3])
    again = d.propose(2)
    assert again.scores[0, 0] == pytest.approx(strong_alpha) and strong.scores[0, 0] == pytest.approx(0.5)
    d.lookup._extend(0, [4, 8, 5])  # (8, 5) and (4, 8, 5) are new: only the 1-gram (5,) matches
    assert d.propose(2).scores[0, 0] == pytest.approx(weak_alpha)


@pytest.mark.parametrize("batch", [1, 3])
def test_with_its_trees_off_the_lookup_drafts_alone_and_the_text_is_exact(tmp_path, monkeypatch, batch):
    """γ auto switches trees that do not pay off (forced here); the lookup's chains are then drafted
    alone (``propose_lookup``), are accepted on repetitive text, and the text is HF's."""
    from speculant.controller import TreeGamma

    monkeypatch.setattr(TreeGamma, "_trees_pay", lambda self, batch: False)
    target = tiny_llama(0, layers=2)
    drafter = HybridDrafter(load_eagle(_random_eagle_folder(tmp_path, target, scale=0.3), target, "tiny"))
    asked = []  # which proposal each pass that drafted asked for
    for name in ("propose", "propose_lookup"):
        real = getattr(drafter, name)
        monkeypatch.setattr(drafter, name, lambda gamma, real=real, name=name: asked.append(name) or real(gamma))
    prompts = _prompts(batch)
    outs = speculant.generate(target, prompts, drafter=drafter, gamma="auto", max_new_tokens=60, path="fast")
    for p, out in zip(prompts, outs):
        ref = hf_greedy(target, p, 60)
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    # after the first passes (which time the trees' widths), the lookup alone drafts, bar a tree retry now and then
    assert "propose_lookup" in asked, asked
    later = asked[asked.index("propose_lookup"):]
    assert later.count("propose_lookup") >= 3 and later.count("propose_lookup") > 2 * later.count("propose"), asked
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0
