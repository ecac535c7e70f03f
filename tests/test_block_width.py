"""Verify blocks padded to a few widths (``block_width`` of the KV states; the buckets in
speculant.models.cuda_graphs): with CUDA graphs each block width is a captured graph, so drafts
are verified in bucketed blocks whose extra columns no row uses. The padding must change nothing:
greedy text equals HF generate, sampled text follows the target's distribution, and seeded rows
keep their text. On a CPU no graphs are captured and nothing is padded, so these tests force it
and check, at the acceptance step, that blocks really were wider than the drafts they held."""
import pytest

import speculant
import speculant.engine
from speculant.drafters import ModelDrafter
from speculant.drafters.eagle import load_eagle
from speculant.drafters.hybrid import HybridDrafter
from speculant.models.backend import Backend
from speculant.models.cuda_graphs import WIDTH_BUCKETS, bucketed_width
from speculant.models.fast import StaticKVState
from speculant.models.kv import KVState
from helpers import hf_greedy, mismatch_report, perturbed, tiny_llama
from test_eagle import _random_eagle_folder
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts
from test_hybrid import _prompts

WIDTHS = []  # (widest draft of any row, columns verified) per pass, seen where drafts are accepted


def _pad(self, width, room):
    """Padding on any device: the next bucket (as with CUDA graphs) and at least two columns more
    than used, within the room, so that every pass with room verifies columns no row uses."""
    return bucketed_width(min(width + 2, max(room, width)), room, 33) if width else 0


@pytest.fixture
def padded(monkeypatch):
    """Force the padding on both paths' states and record each pass's block at acceptance."""
    monkeypatch.setattr(StaticKVState, "block_width", _pad)
    monkeypatch.setattr(KVState, "block_width", _pad)
    accept = speculant.engine._accept

    def spy(scores, probs, prop, *args, **kwargs):
        WIDTHS.append((int(prop.lengths.max()) if prop.lengths.numel() else 0, prop.tokens.shape[1]))
        return accept(scores, probs, prop, *args, **kwargs)

    monkeypatch.setattr(speculant.engine, "_accept", spy)
    WIDTHS.clear()
    yield WIDTHS


def test_widths_go_up_to_a_bucket_within_the_room_and_the_graphs():
    assert [bucketed_width(w, 40, 32) for w in (0, 1, 5, 7, 9, 13, 25, 31)] == [0, 1, 6, 8, 12, 16, 31, 31]
    assert bucketed_width(9, 10, 32) == 10 and bucketed_width(9, 9, 32) == 9  # never past the room
    assert bucketed_width(32, 99, 32) == 32  # a block of 33 tokens is not graphed: no padding
    assert bucketed_width(20, 99, 16) == 20 and bucketed_width(13, 99, 16) == 15  # blocks of at most 16
    assert max(WIDTH_BUCKETS) + 1 == 32  # GraphedForward's default max_width: the widest bucket is graphed


def test_states_without_graphs_verify_exactly_the_drafts():
    target = tiny_llama(0)
    assert KVState(target, 1).block_width(5, 40) == 5
    backend = Backend(target, "fast")
    assert backend.new_state(1, 64).block_width(5, 40) == 5  # CPU: no graphs


def _drafter(kind, target, tmp_path):
    if kind == "tree":
        return HybridDrafter(load_eagle(_random_eagle_folder(tmp_path, target, scale=0.3), target, "tiny"))
    if kind == "model":
        return ModelDrafter(perturbed(target, 0.3, seed=3))
    return kind


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("kind", ["ngram", "model", "tree"])
@pytest.mark.parametrize("batch,gamma", [(1, 5), (3, "auto")])
def test_greedy_identical_to_hf_generate_in_padded_blocks(padded, tmp_path, path, kind, batch, gamma):
    target = tiny_llama(0, layers=2)
    prompts = _prompts(batch)
    outs = speculant.generate(target, prompts, drafter=_drafter(kind, target, tmp_path), gamma=gamma,
                              max_new_tokens=30, path=path)
    for p, out in zip(prompts, outs):
        ref = hf_greedy(target, p, 30)
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert any(v > w for w, v in padded), padded  # some blocks really were padded
    assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0


@pytest.mark.parametrize("kind", ["model", "tree"])
def test_sampling_in_padded_blocks_matches_the_target_distribution(padded, tmp_path, kind):
    target = peaked(0)
    params = PARAMS["t=0.8,top_k=3,rep=1.3"]
    drafter = _drafter(kind, target, tmp_path) if kind == "tree" else ModelDrafter(perturbed(target, 0.5, seed=4))
    # γ 1 leaves room to pad in 4-token continuations (a block never reaches past max_new_tokens)
    counts, alpha = sample_counts(target, drafter, params, seed=17, gamma=1)
    assert any(v > w for w, v in padded)
    pvalue = fit_pvalue(counts, exact_distribution(target, params))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"


def test_seeded_rows_keep_their_text_in_padded_blocks(request, tmp_path):
    target = tiny_llama(0, layers=2)
    prompts = _prompts(3)

    def run():
        outs = speculant.generate(target, prompts, drafter=_drafter("tree", target, tmp_path), gamma=4,
                                  max_new_tokens=24, seed=[5, 6, 7], temperature=0.9, top_p=0.95)
        return [o.token_ids for o in outs]

    plain = run()
    widths = request.getfixturevalue("padded")
    assert run() == plain
    assert any(v > w for w, v in widths)


@pytest.mark.parametrize("kind", ["ngram", "tree"])
def test_the_controller_learns_the_width_it_chose_not_the_padded_one(padded, monkeypatch, tmp_path, kind):
    """Costs are looked up by the width the controller asks about (γ + 1): were they recorded under
    the padded width, a γ that is no bucket would never count as measured, and the controller would
    keep exploring it (a padded block costs what choosing that γ costs)."""
    from speculant.controller import ChainGamma, TreeGamma

    seen = []
    for cls, name in ((ChainGamma, "observe"), (TreeGamma, "observe"), (TreeGamma, "observe_tree")):
        original = getattr(cls, name)

        def spy(self, *args, _original=original, **kwargs):
            width, lens = (args[1], args[2]) if _original.__name__ == "observe" else (args[0], args[1])
            seen.append((width, max(lens, default=0) + 1))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    target = tiny_llama(0, layers=2)
    speculant.generate(target, _prompts(3), drafter=_drafter(kind, target, tmp_path), gamma="auto", max_new_tokens=30)
    assert seen and all(w == chosen for w, chosen in seen), seen
    assert any(v > w for w, v in padded)
