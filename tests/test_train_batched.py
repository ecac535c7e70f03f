"""One trainer interface, two modes: every kind's ``loss_batch`` on right-padded sequences is the mean
of its ``loss`` on each (DFlash and Medusa; EAGLE's: test_eagle.py), and batched training
(speculant.tools.train_batched) continues a DFlash and a Medusa folder into drafters that keep the
target's greedy output."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculant
from speculant.drafters.registry import load_trained
from speculant.models.loading import load_model
from speculant.tools.texts import save_texts
from speculant.tools.train_batched import BatchedSettings, run_batched
from speculant.trained.dflash import DFlashNet, DFlashTrainer, dflash_config
from speculant.trained.medusa import MedusaNet, MedusaTrainer, medusa_config
from helpers import greedy_texts, hf_greedy, save_tiny_folder, tiny_llama
from test_dflash import _random_drafter_folder
from test_eagle import _features
from test_medusa import _random_medusa_folder


def _trainer(kind, target):
    torch.manual_seed(0)
    if kind == "dflash":
        net = DFlashNet(dflash_config(target, "tiny", layers=1, taps=[0, 1], block_size=4, mask_token_id=95,
                                      draft_vocab_size=48))
        ids = torch.arange(0, 96, 2)
        net.d2t.copy_(ids - torch.arange(48))
        net.t2d[ids] = True
        return net, DFlashTrainer(net, target.get_input_embeddings(), target.lm_head, 96, anchors=5), net.fc.weight
    net = MedusaNet(medusa_config(target, "tiny", heads=3, layers=1, draft_vocab_size=None))
    for head in net.heads:
        head[0].linear.weight.data.normal_(0, 0.1)
    return net, MedusaTrainer(net, target.lm_head, 96), net.heads[1][0].linear.weight


@pytest.mark.parametrize("kind", ["dflash", "medusa"])
def test_a_batch_of_padded_sequences_gives_the_mean_of_their_own_losses(kind):
    target = tiny_llama(0)
    net, trainer, weight = _trainer(kind, target)
    g = torch.Generator().manual_seed(2)
    feats = [_features(target, torch.randint(2, 96, (n,), generator=g).tolist(), [0, 1]) for n in (23, 15, 9, 12)]
    for f, start in zip(feats, (5, 0, 4, 12)):  # the last: all prompt, nothing to learn (it must not count)
        f.loss_from = start
        f.labels = torch.randint(0, 96, (len(f.ids),), generator=g)
    rng = random.Random(3)
    singles = [trainer.loss(f, rng)[0] for f in feats]
    assert singles[-1] is None
    want = torch.stack(singles[:-1]).mean()
    T = max(len(f.ids) for f in feats)

    def padded(x):
        return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1) + [0, T - len(x)])

    got, _ = trainer.loss_batch(*(torch.stack([padded(getattr(f, k)) for f in feats]) for k in ("ids", "hidden", "final")),
                                torch.tensor([f.loss_from for f in feats]), torch.tensor([len(f.ids) for f in feats]),
                                torch.stack([padded(f.labels) for f in feats]), rng=random.Random(3))
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    grads = torch.autograd.grad(got, weight)[0]
    assert torch.allclose(grads, torch.autograd.grad(want, weight)[0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["dflash", "medusa"])
def test_batched_training_continues_a_folder_into_a_lossless_drafter(tmp_path, kind):
    folder = save_tiny_folder(tmp_path / "target", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    start = (_random_drafter_folder(tmp_path, model, draft_vocab=48) if kind == "dflash"
             else _random_medusa_folder(tmp_path, model, draft_vocab=48))
    texts = greedy_texts(model, 10, 16)
    save_texts(texts, tmp_path / "texts.pt")
    out = tmp_path / "trained"
    log = run_batched(BatchedSettings(data=[str(tmp_path / "texts.pt")], config=str(start), init=str(start),
                                      out=str(out), target=str(folder), device="cpu", dtype="float32", steps=4,
                                      batch=4, held_out=2, eval_every=2, lr=3e-3, warmup=2), log=lambda *a: None)
    assert log["steps"] == 4 and [e["step"] for e in log["evals"]] == [2, 4] and log["shipped_held_out"]["tau"] >= 1
    assert all(x == x and x < 100 for x in log["loss_curve"])  # finite
    target = load_model(str(folder), device="cpu", dtype="float32")
    drafter = load_trained(str(out), target)
    prompts = [t[0][: t[1]].long().tolist() for t in texts[:3]]
    outs = speculant.generate(target.model, prompts, drafter=drafter, gamma=3, max_new_tokens=16)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target.model, p, 16)


def test_batched_training_resumes_from_its_checkpoint(tmp_path):
    """With a --work folder the batched mode checkpoints at each evaluation (the one loop's), and a
    run with resume continues there (its network, optimiser and step)."""
    folder = save_tiny_folder(tmp_path / "target", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    start = _random_drafter_folder(tmp_path, model, draft_vocab=48)
    save_texts(greedy_texts(model, 10, 16), tmp_path / "texts.pt")
    common = dict(data=[str(tmp_path / "texts.pt")], config=str(start), init=str(start), target=str(folder),
                  device="cpu", dtype="float32", batch=4, held_out=2, eval_every=2, lr=3e-3, warmup=2)
    first = run_batched(BatchedSettings(out=str(tmp_path / "a"), steps=2, work=str(tmp_path / "work"), **common),
                        log=lambda *a: None)
    assert (tmp_path / "work" / "checkpoint-dflash.pt").is_file() and first["steps"] == 2
    lines = []
    resumed = run_batched(BatchedSettings(out=str(tmp_path / "b"), steps=4, work=str(tmp_path / "work"), resume=True,
                                          **common), log=lines.append)
    assert any("resumed at step 2/4" in line for line in lines), lines
    assert resumed["steps"] == 4 and len(resumed["loss_curve"]) == 2 and [e["step"] for e in resumed["evals"]] == [4]
