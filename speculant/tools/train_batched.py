"""Batched training: a drafter trained further on a GPU, more text and more steps than a CPU affords.

`speculant train` (tools/train.py) builds a feature cache on disk and trains one sequence at a time:
right for a 2-core CPU. On a GPU the target's forward is nearly free, so here the target's tapped
states are computed on the fly for a batch of right-padded sequences per step (``tapped``, then the
kind's ``loss_batch``), over text files (tools/texts.py). Sequence lengths are padded up to
multiples of ``BUCKET``: every new shape cost ~0.4 s on an H100 (500 ms a step without buckets,
~70 ms with them, batch 16). On a CPU with native bf16 matmuls (AMX) it trains under bf16 autocast
at ~1,100 tokens/s (EAGLE, 2 cores, batch 8).

It continues a drafter folder (``config``: its kind and shape; ``init``: its weights, else the
kind's fresh start) and writes the LM head apart from the rest (the GPU machine returns files of 16
MiB at most); ``join`` makes one ``model.safetensors`` of them again. scripts/gpu_eagle.py is its
command line.
"""
from __future__ import annotations

import functools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from ..drafters.registry import read_trained
from ..models.loading import load_model
from ..trained.data import Features
from ..trained.format import default_taps, load_state, tapped_layers
from .texts import load_texts
from .train import TrainSettings, _network, adamw, bf16_state, draft_vocabulary, mixed_precision, set_lr

BUCKET = 128  # sequence lengths are padded up to a multiple of this: few shapes (each new one ~0.4 s on a GPU)
_log = functools.partial(print, flush=True)


@dataclass
class BatchedSettings:
    data: list[str] = field(default_factory=list)  # text files (tools/texts.py)
    config: str = ""  # a drafter folder whose config to train (the shipped one)
    out: str = ""
    init: str | None = None  # a trained drafter's folder to continue from (its draft vocabulary too)
    target: str = "default"
    device: str = "cuda"
    dtype: str = "bfloat16"  # the target's
    epochs: float = 8
    steps: int | None = None  # exactly this many steps (else epochs, cut to fit minutes)
    minutes: float | None = None
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    seq_len: int = 1152
    held_out: int = 64
    eval_every: int = 500
    seed: int = 0


def batches(texts: list, batch: int, rng: random.Random) -> list[list[int]]:
    """Batches (indices into ``texts``) of sequences of similar length (less padding), in random order."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i][0]), rng.random()))
    chunks = [order[i : i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(chunks)
    return chunks


def tapped(model, taps: list[int], texts: list, idx: list[int], seq_len: int, device, bucket: int = BUCKET) -> tuple:
    """Texts ``idx`` (at most ``seq_len`` + 1 tokens each) as a batch for a trainer's ``loss_batch``:
    right-padded ids [B, T] (each sequence but its last token; T a multiple of ``bucket``), the
    target's (a transformers causal LM's) states at the taps [B, T, taps, H] and its final normed
    states [B, T, H], answer starts [B], lengths [B] and the text's next tokens [B, T] (the target's
    choices in self-distilled text)."""
    rows = [texts[i][0][: seq_len + 1].long() for i in idx]
    T = -(-(max(len(r) for r in rows) - 1) // bucket) * bucket
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r) - 1] = r[:-1]
        labels[i, : len(r) - 1] = r[1:]
    ids = ids.to(device)
    with torch.no_grad():
        hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    return (ids, torch.stack([hs[t] for t in taps], 2), hs[model.config.num_hidden_layers],
            torch.tensor([texts[i][1] for i in idx], device=device),
            torch.tensor([len(r) - 1 for r in rows], device=device), labels.to(device))


def tapped_features(model, taps: list[int], texts: list, seq_len: int, device) -> list[Features]:
    """Each text's features as `speculant train` caches them (one target pass each, no padding), for
    a trainer's ``evaluate``."""
    out = []
    for i in range(len(texts)):
        ids, aux, final, loss_from, lengths, labels = tapped(model, taps, texts, [i], seq_len, device)
        k = int(lengths[0])
        out.append(Features(ids[0, :k], int(loss_from[0]), aux[0, :k], labels[0, :k].cpu(), final[0, :k]))
    return out


def run_batched(s: BatchedSettings, log=_log) -> dict:
    """Train the drafter of folder ``s.config`` on the texts ``s.data`` in batches; write ``s.out``
    (rest.safetensors + lm_head.safetensors: ``join`` them; config.json; gpu_training.json with the
    loss curve and the held-out evaluations, the shipped folder's among them). Returns that log."""
    t0 = time.time()
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    target = load_model(s.target, device=s.device, dtype=s.dtype)
    model = target.model
    model.requires_grad_(False)
    kind, shipped = read_trained(s.config)
    taps = tapped_layers(shipped) or default_taps(model.config.num_hidden_layers)
    texts = [t for f in s.data for t in load_texts(f) if len(t[0]) - t[1] >= 2]
    rng.shuffle(texts)
    held, trainset = texts[: s.held_out], texts[s.held_out :]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    draft_size = shipped.get("draft_vocab_size") or vocab
    answers = [SimpleNamespace(labels=t[0][1:].long(), loss_from=t[1]) for t in trainset]
    d2t, t2d = draft_vocabulary(answers, draft_size, vocab)
    settings = TrainSettings(kind=kind.name, target=s.target, **kind.settings_of(shipped))
    cfg, net, trainer = _network(settings, target, taps, draft_size, d2t, t2d)
    if s.init:  # continue a trained drafter (its draft vocabulary too)
        net.load_state_dict({k: v.to(s.device) for k, v in load_state(s.init).items()}, strict=False)
        # the trainer's LM-head rows follow the draft vocabulary, which the loaded weights replaced
        trainer = kind.trainer(net, target, settings)
    net.float()
    opt = adamw(net.parameters(), s.lr)
    total, step, curve, log_ = s.steps or int(s.epochs * math.ceil(len(trainset) / s.batch)), 0, [], {"evals": []}
    held_f = tapped_features(model, taps, held, s.seq_len, s.device)

    def evaluate(net_, trainer_) -> dict:
        net_.eval()
        with mixed_precision(s.device, s.dtype):
            m = trainer_.evaluate(held_f, random.Random(1))
        net_.train()
        return m

    # the shipped drafter on the same held-out text, for comparison
    ref = kind.network(shipped).to(s.device)
    ref.load_state_dict({k: v.float() for k, v in load_state(s.config).items()}, strict=False)
    log_["shipped_held_out"] = evaluate(ref, kind.trainer(ref, target, settings))
    log(f"shipped head, held out: {log_['shipped_held_out']}")
    del ref
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(metrics):
        state = bf16_state(net)
        head = {k: state.pop(k).contiguous() for k in ["lm_head.weight"] if k in state}
        save_file(head, str(out / "lm_head.safetensors"))  # apart: files come back from a GPU machine 16 MiB at most
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "rest.safetensors"))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        log_.update(steps=step, total_steps=total, train_sequences=len(trainset), held_out_sequences=len(held),
                    train_tokens=sum(len(x) for x, _ in trainset), seconds=round(time.time() - t0, 1),
                    settings=asdict(s), loss_curve=curve, held_out=metrics)
        (out / "gpu_training.json").write_text(json.dumps(log_, indent=1) + "\n")

    t_train, budget = time.time(), (s.minutes or 0) * 60
    while step < total:
        for idx in batches(trainset, s.batch, rng):
            if step >= total:
                break
            set_lr(opt, s.lr, step, s.warmup, total)
            batch = tapped(model, taps, trainset, idx, s.seq_len, s.device)
            with mixed_precision(s.device, s.dtype):
                loss, _ = trainer.loss_batch(*batch, rng=rng)
            if loss is None:
                continue
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            step += 1
            curve.append(round(float(loss.detach()), 4))
            if step == 15:
                t15 = time.time()
            if step == 45 and s.minutes and not s.steps:  # fit the schedule into the time budget
                per_step = (time.time() - t15) / 30
                fits = step + int((budget - (time.time() - t_train)) / per_step)
                if fits < total:
                    log(f"{per_step * 1000:.0f} ms/step: {total} steps do not fit {s.minutes} min; {fits}")
                    total = fits
            if step % s.eval_every == 0 or step == total:
                m = evaluate(net, trainer)
                log_["evals"].append({"step": step, "seconds": round(time.time() - t_train), **m})
                log(f"step {step}/{total} loss {curve[-1]:.3f} held-out τ {m['tau']:.3f} α {m['alpha_by_slot']} "
                    f"{time.time() - t_train:.0f}s")
                save(m)
    m = evaluate(net, trainer)
    save(m)
    log(f"done: {step} steps, held-out τ {m['tau']:.3f} (shipped {log_['shipped_held_out']['tau']:.3f}) "
        f"in {time.time() - t0:.0f}s")
    return log_


def join(out) -> int:
    """``run_batched`` writes the LM head apart: one ``model.safetensors`` again, a drafter folder
    ``--drafter trained:DIR`` loads. Returns the number of tensors."""
    out = Path(out)
    state = load_file(str(out / "rest.safetensors")) | load_file(str(out / "lm_head.safetensors"))
    save_file({k: state[k].contiguous() for k in sorted(state)}, str(out / "model.safetensors"))
    for part in ("rest", "lm_head"):
        (out / f"{part}.safetensors").unlink()
    return len(state)
