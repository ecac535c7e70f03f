"""Verify blocks padded to a few widths (speculant.models.backend.Backend.block_width): with CUDA
graphs each width is a captured graph, so drafts are verified in bucketed blocks whose extra
columns no row uses. The padding must change nothing: greedy text equals HF generate, sampled
text follows the target's distribution, and seeded rows keep their text. On a CPU no graphs are
captured and no padding happens, so these tests force it."""
import pytest
import torch

import speculant
from speculant.drafters import ModelDrafter
from speculant.drafters.eagle import load_eagle
from speculant.drafters.hybrid import HybridDrafter
from speculant.models.backend import WIDTH_BUCKETS, Backend
from helpers import hf_greedy, mismatch_report, perturbed, tiny_llama
from test_eagle import _random_eagle_folder
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts

WIDTHS = []  # (used, verified) per pass


@pytest.fixture
def padded(monkeypatch):
    original = Backend.block_width
    monkeypatch.setattr(Backend, "block_width", lambda self, width, room: _bucketed(self, original, width, room))
    WIDTHS.clear()
    yield WIDTHS


def _bucketed(self, original, width, room):
    """Padding on any device: the next bucket (as with CUDA graphs) and at least two columns more
    than used, within the room, so that every pass with room verifies columns no row uses."""
    step, self.step = self.step, object()
    try:
        out = original(self, min(width + 2, max(room, width)) if width else 0, room)
    finally:
        self.step = step
    WIDTHS.append((width, out))
    return out


def test_widths_go_up_to_a_bucket_within_the_room():
    backend = Backend(tiny_llama(0), "general")
    assert backend.block_width(5, 40) == 5  # no graphs: no padding
    backend.step = object()
    assert [backend.block_width(w, 40) for w in (0, 1, 5, 7, 9, 13, 31)] == [0, 1, 6, 8, 12, 16, 32]
    assert backend.block_width(9, 10) == 10 and backend.block_width(9, 9) == 9  # never past the room
    assert backend.block_width(40, 99) == 40 and max(WIDTH_BUCKETS) == 32


def _prompts(batch):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(2, 96, (4,), generator=g).tolist() * 6)[: 5 + 3 * i] for i in range(batch)]


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


def test_seeded_rows_keep_their_text_in_padded_blocks(monkeypatch, tmp_path):
    target = tiny_llama(0, layers=2)
    prompts = _prompts(3)

    def run():
        outs = speculant.generate(target, prompts, drafter=_drafter("tree", target, tmp_path), gamma=4,
                                  max_new_tokens=24, seed=[5, 6, 7], temperature=0.9, top_p=0.95)
        return [o.token_ids for o in outs]

    plain = run()
    original = Backend.block_width
    monkeypatch.setattr(Backend, "block_width", lambda self, width, room: _bucketed(self, original, width, room))
    WIDTHS.clear()
    assert run() == plain
    assert any(v > w for w, v in WIDTHS)
