"""EAGLE-3 drafters (issue: trained drafters): the drafter proposes what training evaluates, greedy
identity with HF generate (chains and trees, both paths, batches), sampling by chi-square, the
speculators format both ways (our network against speculators' on a folder we saved; a folder it
saved runs here), the draft vocabulary, reload, training, and the one-line refusals."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import speculant
from speculant.drafters.base import DraftContext
from speculant.drafters.eagle import load_eagle
from speculant.errors import SpeculantError
from speculant.models.backend import Backend
from speculant.sampling import LogitsProcessing, SamplingParams
from speculant.trained.data import Features
from speculant.trained.eagle import EagleNet, EagleTrainer, eagle_config
from speculant.trained.format import save_folder
from helpers import hf_greedy, mismatch_report, save_tiny_folder, tiny_llama
from test_dflash import _jsonl
from test_engine_sampling import PARAMS, exact_distribution, fit_pvalue, peaked, sample_counts

TAPS = [0, 1, 2]


def _random_eagle_folder(tmp_path, target, draft_vocab=None, seed=0, name="eagle", scale=1.0, verifier="tiny"):
    cfg = eagle_config(target, verifier, TAPS[: target.config.num_hidden_layers], draft_vocab, steps=3)
    torch.manual_seed(seed)
    net = EagleNet(cfg)
    with torch.no_grad():
        if net.draft_vocab:  # the draft vocabulary: target ids 0, 2, 4, ...
            ids = torch.arange(0, 2 * net.d2t.shape[0], 2)
            net.d2t.copy_(ids - torch.arange(len(ids)))
            net.t2d[ids] = True
            net.lm_head.weight.copy_(target.lm_head.weight[ids])
        else:
            net.lm_head.weight.copy_(target.lm_head.weight)
        net.layers[0].mlp.down_proj.weight.mul_(scale)
    folder = tmp_path / name
    save_folder(folder, cfg, dict(net.state_dict()))
    return folder


def _features(target, ids: list[int], taps=TAPS) -> Features:
    """One sequence's features as `speculant train` caches them (one target pass)."""
    state = Backend(target, "general").new_state(1, len(ids) + 8)
    n = target.config.num_hidden_layers
    _, hidden = state.append(torch.tensor([ids]), taps=(*taps, n))
    return Features(torch.tensor(ids), 0, hidden[0, :, :-1], torch.zeros(len(ids), dtype=torch.long),
                    hidden[0, :, -1])


def _drafter_after(drafter, target, ids: list[int], next_token: int):
    """The drafter as the engine leaves it after a prefill of ``ids`` whose next token is ``next_token``."""
    f = _features(target, ids, list(drafter.hidden_layers))
    drafter.start(DraftContext([ids], LogitsProcessing(SamplingParams()), None, torch.device("cpu"), 96, 128, None,
                               [f.hidden]))
    drafter.update([[next_token]], [0])
    return drafter


def test_the_drafter_proposes_what_training_evaluates(tmp_path, monkeypatch):
    """Row i of a training sequence (target features at i, token i+1) drafts a chain by feeding its
    own guesses; the drafter, after the same text, puts that chain at the top of its tree with the
    same log-probabilities (positions, pairing of features with tokens, the fed-back states)."""
    import speculant.drafters.eagle as eagle

    monkeypatch.setattr(eagle, "MIN_SCORE", 0.0)  # every depth, however unlikely (a random head)
    target = tiny_llama(0, layers=3)
    folder = _random_eagle_folder(tmp_path, target, draft_vocab=40)
    net = load_eagle(folder, target, "tiny").net
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 96, (20,), generator=g).tolist()
    f = _features(target, ids)
    trainer = EagleTrainer(net, target.get_input_embeddings(), target.lm_head, steps=3)
    logps = [x.log_softmax(-1) for x in trainer._run(f, 3, own_tokens=True)]
    for i in (4, 11, 17):
        drafter = _drafter_after(load_eagle(folder, target, "tiny"), target, ids[: i + 1], ids[i + 1])
        prop = drafter.propose(10**6)  # every candidate
        tokens, parents, scores = prop.tokens[0].tolist(), prop.parents[0].tolist(), prop.scores[0]
        node, total = -1, 0.0
        for k in range(3):  # follow the chain of its best guesses
            pick = int(logps[k][i].argmax())
            total += float(logps[k][i, pick])
            node = next(j for j, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == pick * 2)
            assert float(scores[node].log()) == pytest.approx(total, abs=1e-4)
        assert scores.tolist() == sorted(scores.tolist(), reverse=True)
        assert all(p < j for j, p in enumerate(parents))


def test_a_batch_of_padded_sequences_gives_the_mean_of_their_own_losses():
    """The batched loss (a GPU trains many sequences a step) over right-padded sequences of other
    lengths and answer starts equals the mean of each one's loss alone, and so do the gradients."""
    target = tiny_llama(0, layers=3)
    cfg = eagle_config(target, "tiny", TAPS, None, steps=3)
    torch.manual_seed(0)
    net = EagleNet(cfg)
    net.lm_head.weight.data.copy_(target.lm_head.weight)
    trainer = EagleTrainer(net, target.get_input_embeddings(), target.lm_head, steps=3, decay=0.8)
    g = torch.Generator().manual_seed(2)
    feats = [_features(target, torch.randint(2, 96, (n,), generator=g).tolist()) for n in (23, 15, 9, 12)]
    for f, start in zip(feats, (5, 0, 7, 12)):  # the last: all prompt, no answer row (it must not count)
        f.loss_from = start
    singles = [trainer.loss(f, None)[0] for f in feats]
    assert singles[-1] is None
    singles = singles[:-1]
    T = max(len(f.ids) for f in feats)

    def padded(x):
        return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1) + [0, T - len(x)])

    got, rows = trainer.loss_batch(torch.stack([padded(f.ids) for f in feats]), torch.stack([padded(f.hidden) for f in feats]),
                                   torch.stack([padded(f.final) for f in feats]), torch.tensor([f.loss_from for f in feats]),
                                   torch.tensor([len(f.ids) for f in feats]))
    want = torch.stack(singles).mean()
    assert rows == sum(max(len(f.ids) - 1 - max(f.loss_from - 1, 0), 0) for f in feats)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    grads = torch.autograd.grad(got, net.fc.weight)[0]
    assert torch.allclose(grads, torch.autograd.grad(want, net.fc.weight)[0], rtol=1e-4, atol=1e-7)


def test_the_loss_is_the_decayed_mean_kl_of_each_steps_answer_rows():
    """loss (head_kl over weighted rows) against the loss written out with kl_div: per training-time
    step k, the mean KL(target ‖ draft) over the answer rows that have a token k steps on, row i
    judged on the target's distribution at position i + 1 + k, weighted decay^k; gradients too."""
    target = tiny_llama(0, layers=3)
    net = EagleNet(eagle_config(target, "tiny", TAPS, None, steps=3))
    trainer = EagleTrainer(net, target.get_input_embeddings(), target.lm_head, steps=3, decay=0.8)
    f = _features(target, torch.randint(2, 96, (23,), generator=torch.Generator().manual_seed(3)).tolist())
    f.loss_from = 5
    got, _ = trainer.loss(f, None)
    target_logp = (f.final[1:] @ trainer.target_rows.T).log_softmax(-1)
    first, n = f.loss_from - 1, len(f.ids) - 1
    total = weight = 0.0
    for k, logits in enumerate(trainer._run(f, 3, own_tokens=False)):
        rows = torch.arange(first, n - k)
        kl = torch.nn.functional.kl_div(logits[rows].log_softmax(-1), target_logp[rows + k], log_target=True,
                                        reduction="none").sum(-1)
        total, weight = total + 0.8 ** k * kl.mean(), weight + 0.8 ** k
    want = total / weight
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for p in (net.fc.weight, net.lm_head.weight):
        assert torch.allclose(torch.autograd.grad(got, p, retain_graph=True)[0],
                              torch.autograd.grad(want, p, retain_graph=True)[0], rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target (a folder with a tokenizer) and an EAGLE head `speculant train` trained on its
    own greedy answers: a drafter that is often right, so deep tree paths get accepted."""
    from speculant.tools.train import TrainSettings, run_train

    tmp = tmp_path_factory.mktemp("eagle")
    target_dir = save_tiny_folder(tmp / "target", seed=0)
    data = _jsonl(tmp / "data.jsonl", n=48)
    common = dict(kind="eagle", target=str(target_dir), data=str(data), draft_vocab=64, batch=4, eval_sequences=4,
                  checkpoint_every=1000, work=str(tmp / "cache"), taps=[0, 1])
    first = run_train(TrainSettings(out=str(tmp / "e1"), steps=1, **common), progress_bar=False, log=lambda *a: None)
    summary = run_train(TrainSettings(out=str(tmp / "e2"), steps=100, lr=3e-3, **common), progress_bar=False,
                        log=lambda *a: None)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir).eval(), tmp / "e2", target_dir, first, summary


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [1, 6, "auto"])
def test_eagle_greedy_identical_to_hf_generate(trained, path, batch, gamma):
    target, folder = trained[:2]
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(2, 96, (4,), generator=g).tolist() * 6)[: 5 + 3 * i] for i in range(batch)]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    outs = speculant.generate(target, prompts if batch > 1 else prompts[0], drafter=load_eagle(folder, target, "tiny"),
                              gamma=gamma, max_new_tokens=30, path=path)
    outs = outs if batch > 1 else [outs]
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, mismatch_report(target, p, ref, out.token_ids)
    if gamma != 1:  # (one node a pass: the head's single best guess, here often wrong)
        assert sum(o.stats["accepted_draft_tokens"] for o in outs) > 0


def test_eagle_sampling_matches_the_target_distribution(tmp_path):
    target = peaked(0)
    folder = _random_eagle_folder(tmp_path, target, scale=0.0)
    counts, alpha = sample_counts(target, load_eagle(folder, target, "tiny"), PARAMS["t=0.8,top_k=3,rep=1.3"], seed=5)
    pvalue = fit_pvalue(counts, exact_distribution(target, PARAMS["t=0.8,top_k=3,rep=1.3"]))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e} (acceptance {alpha:.2f})"
    assert 0.02 < alpha < 0.98, alpha


def test_draft_vocabulary_reload_and_trained_dispatch(tmp_path):
    target = tiny_llama(0, layers=3)
    folder = _random_eagle_folder(tmp_path, target, draft_vocab=32)
    a = _drafter_after(load_eagle(folder, target, "tiny"), target, [3, 5, 7, 9, 11], 4)
    loaded = speculant.models.LoadedModel(target, None, "tiny")
    b = speculant.drafters.make_drafter(f"trained:{folder}", loaded)
    assert type(b) is type(a)
    b = _drafter_after(b, target, [3, 5, 7, 9, 11], 4)
    pa, pb = a.propose(12), b.propose(12)
    assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.parents, pb.parents)
    assert bool((pa.tokens % 2 == 0).all()) and int(pa.tokens.max()) < 64  # only draft-vocabulary ids
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    out = speculant.generate(target, prompt, drafter=load_eagle(folder, target, "tiny"), gamma=6, max_new_tokens=20)
    assert out.token_ids == hf_greedy(target, prompt, 20)


def _speculators_model(cfg_dict_or_folder):
    spec = pytest.importorskip("speculators.models.eagle3")
    model = spec.Eagle3DraftModel.from_pretrained(str(cfg_dict_or_folder))
    return model.float().eval()


def test_our_network_equals_speculators_eagle3_on_a_folder_we_saved(tmp_path, float32_drafts):
    """speculators loads our folder; its training-time-test forward (teacher forcing) drafts what ours does
    (both in float32: beside a target on the kernel core ours would run on the int8 kernels)."""
    pytest.importorskip("speculators.models.eagle3")
    target_dir = save_tiny_folder(tmp_path / "target", seed=0)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).float()
    folder = _random_eagle_folder(tmp_path, target, draft_vocab=48, verifier=str(target_dir))
    cfg = json.loads((folder / "config.json").read_text())
    # not flex attention (a GPU kernel); the public key: transformers 5.25 ignores "_attn_implementation" in a saved config
    cfg["transformer_layer_config"]["attn_implementation"] = "sdpa"
    (folder / "config.json").write_text(json.dumps(cfg))
    theirs = _speculators_model(folder)
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    ours = load_eagle(folder, target, "tiny").net.float()
    ids = torch.randint(2, 96, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    f = _features(target, ids, ours.taps)
    with torch.no_grad():
        want = theirs(hidden_states=f.hidden[:-1].flatten(1)[None], input_ids=torch.tensor([ids[1:]]),
                      document_ids=torch.zeros(1, len(ids) - 1, dtype=torch.long), ttt_steps=3)
        trainer = EagleTrainer(ours, target.get_input_embeddings(), target.lm_head, steps=3)
        got = [x.argmax(-1) for x in trainer._run(f, 3, own_tokens=False)]
    for k in range(3):  # rows past the end are fillers in both (they may differ there)
        n = len(ids) - 1 - k
        assert torch.equal(got[k][:n], want[k][0, :n]), k


def test_a_folder_speculators_saved_runs_in_speculant(tmp_path):
    spec = pytest.importorskip("speculators.models.eagle3")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    target = tiny_llama(0, layers=3)
    layer = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    layer._attn_implementation = "sdpa"
    cfg = spec.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=96, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        norm_before_residual=True, speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    theirs = spec.Eagle3DraftModel(cfg)
    with torch.no_grad():  # speculators copies the LM head and embeddings from the verifier
        theirs.lm_head.weight.copy_(target.lm_head.weight)
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    theirs.save_pretrained(tmp_path / "theirs")
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    out = speculant.generate(target, prompt, drafter=load_eagle(tmp_path / "theirs", target, "tiny"), gamma=4,
                             max_new_tokens=20)
    assert out.token_ids == hf_greedy(target, prompt, 20)
    assert out.stats["draft_tokens"] > 0


def test_training_lowers_the_loss_and_the_folder_drafts_losslessly(trained):
    target, folder, target_dir, first, summary = trained
    curve = summary["loss_curve"]
    assert sum(curve[-10:]) / 10 < 0.7 * sum(curve[:10]) / 10, curve
    assert summary["held_out"]["tau"] > first["held_out"]["tau"] + 0.5, (first["held_out"], summary["held_out"])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 64
    gen = speculant.load(str(target_dir), drafter=f"eagle:{folder}", dtype="float32", gamma=8)
    ids = gen.tokenizer("w3 w7 w3 w7 w3 w7")["input_ids"]
    out = gen.generate_ids([ids], max_new_tokens=16)[0]
    assert out.token_ids == hf_greedy(gen.target.model, ids, 16)[: len(out.token_ids)]
    assert out.stats["accepted_draft_tokens"] > 0, out.stats


def test_refusals_are_one_line(tmp_path, capsys):
    from speculant.cli import main

    target = tiny_llama(0, layers=3)
    folder = _random_eagle_folder(tmp_path, target)
    with pytest.raises(SpeculantError, match="holds a eagle drafter, not dflash"):
        speculant.drafters.validate_drafter_spec(f"dflash:{folder}")
    with pytest.raises(SpeculantError, match="was trained for tiny, not for other"):
        load_eagle(folder, tiny_llama(1, layers=3), "other")
    code = main(["generate", "hi", "--drafter", f"eagle:{tmp_path / 'missing'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no config.json" in err, err


@pytest.mark.parametrize("damage", ["list", "no_layer_config", "layer_config_text", "vocab_text", "weights"])
def test_a_malformed_folder_is_one_error_naming_it(tmp_path, damage):
    target = tiny_llama(0, layers=3)
    folder = _random_eagle_folder(tmp_path, target, draft_vocab=32)
    cfg = json.loads((folder / "config.json").read_text())
    if damage == "list":
        cfg = [1, 2, 3]
    elif damage == "no_layer_config":
        del cfg["transformer_layer_config"]
    elif damage == "layer_config_text":
        cfg["transformer_layer_config"] = "x"
    elif damage == "vocab_text":
        cfg["draft_vocab_size"] = "abc"
    else:
        (folder / "model.safetensors").write_text("garbage")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculantError, match="not an object" if damage == "list" else "is malformed") as e:
        load_eagle(folder, target, "tiny")
    assert str(folder) in str(e.value) and "\n" not in str(e.value)


def test_stopping_the_tree_early_leaves_the_proposal_unchanged(trained, monkeypatch):
    """Deepening stops once no deeper node could enter the best `gamma`: the proposal is the first
    `gamma` nodes of the whole tree grown to full depth."""
    import speculant.drafters.eagle as eagle

    monkeypatch.setattr(eagle, "MIN_SCORE", 0.0)
    target, folder = trained[:2]
    ids = [5, 9, 13, 5, 9, 13, 5, 9]
    for budget in (3, 8, 16, 40):
        cut = _drafter_after(load_eagle(folder, target, "tiny"), target, ids, 13).propose(budget)
        whole = _drafter_after(load_eagle(folder, target, "tiny"), target, ids, 13).propose(10**6)
        n = int(cut.lengths[0])
        assert n == min(budget, int(whole.lengths[0]))
        assert torch.equal(cut.tokens[0, :n], whole.tokens[0, :n]) and torch.equal(cut.parents[0, :n], whole.parents[0, :n])



@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), max_size=6), st.integers(0, 20))
def test_feature_blocks_split_at_any_row(sizes, k):
    """The head keeps its unfed and waiting features as lists of blocks (none empty): the first k
    rows and the rest, split across blocks, are the whole's rows in order, in blocks none empty."""
    from speculant.drafters.eagle import _split_rows, joined_rows

    blocks = [torch.arange(n * 2, dtype=torch.float32).view(n, 2) + 100 * i for i, n in enumerate(sizes)]
    whole = torch.cat(blocks) if blocks else torch.zeros(0, 2)
    first, rest = _split_rows(blocks, k)
    taken = min(k, whole.shape[0])
    assert all(b.shape[0] > 0 for b in first + rest)
    assert torch.equal(joined_rows(first) if first else whole[:0], whole[:taken])
    assert torch.equal(joined_rows(rest) if rest else whole[:0], whole[taken:])
