"""Medusa heads (issue: trained drafters): the best-first tree against brute force, greedy identity
with HF generate (chains cut from trees, trees; both paths; batches), sampling by chi-square,
save / reload, the draft vocabulary, training, and the one-line refusals."""
import itertools
import json

import pytest
import torch

import speculant
from speculant.cli import main
from speculant.drafters.medusa import best_first, load_medusa
from speculant.errors import SpeculantError
from speculant.trained.format import save_folder
from speculant.trained.medusa import MedusaNet, medusa_config
from helpers import hf_greedy, mismatch_report, save_tiny_folder, tiny_llama
from test_dflash import _jsonl
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts


def _random_medusa_folder(tmp_path, target, heads=3, draft_vocab=None, seed=0, scale=0.3, name="medusa"):
    cfg = medusa_config(target, "tiny", heads=heads, layers=1, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    net = MedusaNet(cfg)
    with torch.no_grad():
        for head in net.heads:  # not the zero start: heads that guess something, often wrong
            head[0].linear.weight.normal_(0, scale / target.config.hidden_size ** 0.5)
        if net.draft_vocab:
            ids = torch.arange(0, 2 * net.d2t.shape[0], 2)  # the draft vocabulary: target ids 0, 2, 4, ...
            net.d2t.copy_(ids - torch.arange(len(ids)))
            net.t2d[ids] = True
            net.lm_head.weight.copy_(target.lm_head.weight[ids])
    folder = tmp_path / name
    save_folder(folder, cfg, dict(net.state_dict()))
    return folder


def test_best_first_lists_the_most_probable_paths_nodes_in_score_order():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 4, generator=g).sort(descending=True).values.tolist()
    ids = [[10 * d + c for c in range(4)] for d in range(3)]
    tokens, parents, scores = best_first(probs, ids, 12)
    assert scores == sorted(scores, reverse=True) and all(p < i for i, p in enumerate(parents))
    # brute force: every node (a path prefix) with its product; the 12 best are the ones listed
    every = []
    for depth in range(1, 4):
        for path in itertools.product(range(4), repeat=depth):
            score = 1.0
            for d, c in enumerate(path):
                score *= probs[d][c]
            every.append((score, tuple(ids[d][c] for d, c in enumerate(path))))
    best = sorted(every, reverse=True)[:12]

    def path_of(i):
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = parents[i]
        return tuple(reversed(out))

    assert sorted(path_of(i) for i in range(12)) == sorted(p for _, p in best)
    assert scores == pytest.approx([s for s, _ in best])


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [1, 6, "auto"])
def test_medusa_greedy_identical_to_hf_generate(tmp_path, path, batch, gamma):
    target = tiny_llama(0, layers=2)
    folder = _random_medusa_folder(tmp_path, target)
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(1, 96, (4,), generator=g).tolist() * 6)[: 5 + 3 * i] for i in range(batch)]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    outs = speculant.generate(target, prompts if batch > 1 else prompts[0], drafter=load_medusa(folder, target, "tiny"),
                              gamma=gamma, max_new_tokens=30, path=path)
    outs = outs if batch > 1 else [outs]
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    assert sum(o.stats["draft_tokens"] for o in outs) > 0  # trees were verified (random heads: mostly wrong)


def test_medusa_sampling_matches_the_target_distribution(tmp_path):
    target = peaked(0)
    folder = _random_medusa_folder(tmp_path, target, heads=2, scale=0.0)  # heads = the target's next-token guess
    counts, alpha = sample_counts(target, load_medusa(folder, target, "tiny"), PARAMS["t=0.8,top_k=3,rep=1.3"],
                                  seed=5)
    pvalue = fit_pvalue(counts, exact_distribution(target, PARAMS["t=0.8,top_k=3,rep=1.3"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.02 < alpha < 0.98, alpha


def test_draft_vocabulary_reload_and_trained_dispatch(tmp_path):
    target = tiny_llama(0, layers=2)
    folder = _random_medusa_folder(tmp_path, target, draft_vocab=32)
    net = load_medusa(folder, target, "tiny").net
    logits = net.logits(net(torch.randn(2, 64)), target.lm_head, 96)
    kept = torch.zeros(96, dtype=torch.bool)
    kept[0:64:2] = True
    assert torch.isfinite(logits[..., kept]).all() and torch.isinf(logits[..., ~kept]).all()
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    a = load_medusa(folder, target, "tiny")
    b = speculant.Generator(speculant.models.LoadedModel(target, None, "tiny"),
                            speculant.drafters.make_drafter(f"trained:{folder}", speculant.models.LoadedModel(
                                target, None, "tiny"))).drafter
    assert type(b) is type(a)
    last = torch.randn(2, 64)
    for d in (a, b):
        d.ctx = type("Ctx", (), {"vocab_size": 96, "device": torch.device("cpu")})()
        d.last = last
    pa, pb = a.propose(8), b.propose(8)
    assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.parents, pb.parents)
    out = speculant.generate(target, prompt, drafter=a, gamma=6, max_new_tokens=20)
    assert out.token_ids == hf_greedy(target, prompt, 20)


def test_refusals_are_one_line(tmp_path, capsys):
    target = tiny_llama(0, layers=2)
    folder = _random_medusa_folder(tmp_path, target)
    with pytest.raises(SpeculantError, match="holds a medusa drafter, not dflash"):
        speculant.drafters.validate_drafter_spec(f"dflash:{folder}")
    with pytest.raises(SpeculantError, match="was trained for tiny, not for other"):
        load_medusa(folder, tiny_llama(1, layers=2), "other")
    code = main(["export", "--target", "default", "--drafter", f"medusa:{folder}", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "medusa" in err, err


def test_training_lowers_the_loss_and_the_folder_drafts_losslessly(tmp_path):
    from speculant.tools.train import TrainSettings, run_train

    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    data = _jsonl(tmp_path / "data.jsonl", n=48)
    common = dict(kind="medusa", target=str(target_dir), data=str(data), options={"heads": 3}, draft_vocab=64, batch=4,
                  eval_sequences=4, checkpoint_every=1000, work=str(tmp_path / "cache"))
    first = run_train(TrainSettings(out=str(tmp_path / "m1"), steps=1, **common), progress_bar=False,
                      log=lambda *a: None)
    trained = run_train(TrainSettings(out=str(tmp_path / "m2"), steps=200, lr=1e-2, **common), progress_bar=False,
                        log=lambda *a: None)
    curve = trained["loss_curve"]
    assert sum(curve[-10:]) / 10 < 0.9 * sum(curve[:10]) / 10, curve
    assert trained["held_out"]["tau"] > first["held_out"]["tau"], (first["held_out"], trained["held_out"])
    cfg = json.loads((tmp_path / "m2" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "medusa" and cfg["draft_vocab_size"] == 64
    gen = speculant.load(str(target_dir), drafter=f"medusa:{tmp_path / 'm2'}", dtype="float32", gamma=8)
    ids = gen.tokenizer("w3 w7 w3 w7 w3 w7")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=16)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 16)[: len(out.token_ids)]
    assert out.stats["tree_passes"] > 0


def test_a_kinds_own_settings_are_flags_of_speculant_train(tmp_path, capsys):
    """--heads and --layers, declared by the medusa entry (TrainedKind.options), reach its network
    from the command line; --ttt-steps, another kind's, is taken and ignored; the help names each
    flag's kinds."""
    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    out = tmp_path / "m"
    data = _jsonl(tmp_path / "d.jsonl", n=8)
    code = main(["train", "--kind", "medusa", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--steps", "1", "--batch", "2", "--draft-vocab", "64", "--heads", "2", "--layers", "2",
                 "--ttt-steps", "5", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 2
    settings = json.loads((out / "speculant_training.json").read_text())["settings"]
    assert settings["heads"] == 2 and settings["layers"] == 2 and "ttt_steps" not in settings
    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--heads HEADS medusa: heads" in help_text and "--ttt-steps TTT_STEPS eagle, mtp:" in help_text
