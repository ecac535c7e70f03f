"""Batched training: a drafter trained further on a GPU, more text and more steps than a CPU affords.

`speculant train` (tools/train.py) builds a feature cache on disk and trains one sequence at a time:
right for a 2-core CPU. On a GPU the target's forward is nearly free, so here the target's tapped
states are computed on the fly for a batch of right-padded sequences per step (``tapped``, then the
kind's ``loss_batch``: ``TappedBatches``, the data of the one loop in tools/trainer.py), over text
files (tools/texts.py). Sequence lengths are padded up to multiples of ``BUCKET``: every new shape
cost ~0.4 s on an H100 (500 ms a step without buckets, ~70 ms with them, batch 16). On a CPU with
native bf16 matmuls (AMX) it trains under bf16 autocast at ~1,100 tokens/s (EAGLE, 2 cores, batch 8).

It continues a drafter folder (``config``: its kind and shape; ``init``: its weights, else the
kind's fresh start), with checkpoints in ``work`` (``resume`` continues from there), and writes the
folder at each evaluation. scripts/gpu_eagle.py is its command line (and what only a GPU run
needs: a time budget, the weights in files small enough to come back).
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
from typing import Callable

import torch
from safetensors.torch import save_file

from ..drafters.registry import read_trained
from ..models.loading import load_model
from ..trained.data import Features
from ..trained.format import default_taps, load_state, tapped_layers
from .texts import load_texts
from .train import kind_options, new_network
from .trainer import LoopSettings, Run, adamw, bf16_state, draft_vocabulary, evaluate_held_out, mixed_precision, resume, train_loop

BUCKET = 128  # sequence lengths are padded up to a multiple of this: few shapes (each new one ~0.4 s on a GPU)
_log = functools.partial(print, flush=True)


@dataclass
class BatchedSettings(LoopSettings):
    """The batched mode's settings: the loop's (LoopSettings, some defaults of its own), the texts'
    and the folder's."""

    data: list[str] = field(default_factory=list)  # text files (tools/texts.py)
    config: str = ""  # a drafter folder whose config to train (the shipped one)
    out: str = ""
    init: str | None = None  # a trained drafter's folder to continue from (its draft vocabulary too)
    target: str = "default"
    device: str = "cuda"
    dtype: str = "bfloat16"  # the target's
    epochs: float = 8
    batch: int = 32
    warmup: int = 100
    seq_len: int = 1152
    held_out: int = 64
    eval_every: int = 500  # and a checkpoint each time, where ``work`` is given


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


class TappedBatches:
    """The loop's data in the batched mode: a batch of texts of similar length a step, the target's
    states computed for it on the fly; a batch with no loss takes no step."""

    def __init__(self, model, taps: list[int], texts: list, s: BatchedSettings):
        self.model, self.taps, self.texts, self.s = model, taps, texts, s

    def epoch(self, rng: random.Random) -> list[list[int]]:
        return batches(self.texts, self.s.batch, rng)

    def backward(self, trainer, idx: list[int], rng: random.Random) -> tuple[list[float], int] | None:
        s = self.s
        batch = tapped(self.model, self.taps, self.texts, idx, s.seq_len, s.device)
        with mixed_precision(s.device, s.dtype):
            loss, n = trainer.loss_batch(*batch, rng=rng)
        if loss is None:
            return None
        loss.backward()
        return [float(loss.detach())], n


def write_weights(out: Path, state: dict[str, torch.Tensor]) -> None:
    """The folder's weights, one model.safetensors (``run_batched``'s ``write`` may split them)."""
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))


def run_batched(s: BatchedSettings, log=_log, on_step: Callable[[Run], None] | None = None,
                write: Callable[[Path, dict], None] = write_weights) -> dict:
    """Train the drafter of folder ``s.config`` on the texts ``s.data`` in batches; write ``s.out``
    (the weights through ``write``, config.json, gpu_training.json with the loss curve and the
    held-out evaluations, the shipped folder's among them) at each evaluation. ``on_step(run)``
    follows each step (it may lower ``run.total``). Returns that log."""
    t0 = time.time()
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    target = load_model(s.target, device=s.device, dtype=s.dtype)
    target.model.requires_grad_(False)
    kind, shipped = read_trained(s.config)
    taps = tapped_layers(shipped) or default_taps(target.model.config.num_hidden_layers)
    texts = [t for f in s.data for t in load_texts(f) if len(t[0]) - t[1] >= 2]
    rng.shuffle(texts)
    held, trainset = texts[: s.held_out], texts[s.held_out :]
    run = _batched_run(s, kind, shipped, target, taps, trainset)
    held_f = tapped_features(target.model, taps, held, s.seq_len, s.device)
    log_ = {"evals": [], "shipped_held_out": _shipped_held_out(s, kind, shipped, target, held_f)}
    log(f"shipped head, held out: {log_['shipped_held_out']}")
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(train_sequences=len(trainset), held_out_sequences=len(held),
                 train_tokens=sum(len(x) for x, _ in trainset))
    save = functools.partial(_write_folder, s, run, out, log_, write, sizes, t0)
    evaluate = functools.partial(evaluate_held_out, run.net, run.trainer, held_f, s.device, s.dtype)

    def on_eval(run: Run, m: dict, info: str) -> str:
        log_["evals"].append({"step": run.step, "seconds": round(time.time() - run.started), **m})
        log(f"step {run.step}/{run.total} loss {run.curve[-1]:.3f} held-out τ {m['tau']:.3f} α {m['alpha_by_slot']} "
            f"{time.time() - run.started:.0f}s")
        save(m)
        return info

    if s.resume:
        resume(run, kind.name, log)
    run.started = time.time()
    train_loop(run, TappedBatches(target.model, taps, trainset, s), rng, lr=s.lr, warmup=s.warmup,
               every=s.eval_every, evaluate=evaluate, on_eval=on_eval, on_step=on_step)
    m = evaluate()
    save(m)
    log(f"done: {run.step} steps, held-out τ {m['tau']:.3f} (shipped {log_['shipped_held_out']['tau']:.3f}) "
        f"in {time.time() - t0:.0f}s")
    return log_


def _batched_run(s: BatchedSettings, kind, shipped: dict, target, taps: list[int], trainset: list) -> Run:
    """The network of the folder's kind and shape, over the draft vocabulary of the training
    answers, or continued from ``s.init`` (its draft vocabulary too)."""
    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    draft_size = shipped.get("draft_vocab_size") or vocab
    answers = [SimpleNamespace(labels=t[0][1:].long(), loss_from=t[1]) for t in trainset]
    d2t, t2d = draft_vocabulary(answers, draft_size, vocab)
    options = kind_options(kind, kind.settings_of(shipped))
    cfg, net, trainer = new_network(kind, s.target, options, target, taps, draft_size, d2t, t2d)
    if s.init:  # continue a trained drafter (its draft vocabulary too)
        net.load_state_dict({k: v.to(s.device) for k, v in load_state(s.init).items()}, strict=False)
        # the trainer's LM-head rows follow the draft vocabulary, which the loaded weights replaced
        trainer = kind.trainer(net, target, options)
    net.float()
    total = s.steps or int(s.epochs * math.ceil(len(trainset) / s.batch))
    checkpoint = Path(s.work) / f"checkpoint-{kind.name}.pt" if s.work else None
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
    return Run(net, trainer, adamw([p for p in net.parameters() if p.requires_grad], s.lr), cfg, total, checkpoint)


def _shipped_held_out(s: BatchedSettings, kind, shipped: dict, target, held_f: list) -> dict:
    """The shipped drafter on the same held-out text, for comparison."""
    ref = kind.network(shipped).to(s.device)
    ref.load_state_dict({k: v.float() for k, v in load_state(s.config).items()}, strict=False)
    return evaluate_held_out(ref, kind.trainer(ref, target, kind_options(kind, kind.settings_of(shipped))), held_f,
                             s.device, s.dtype)


def _write_folder(s: BatchedSettings, run: Run, out: Path, log_: dict, write, sizes: dict, t0: float,
                  metrics: dict) -> None:
    """The folder as it stands: weights (bfloat16), config.json, gpu_training.json."""
    write(out, bf16_state(run.net))
    (out / "config.json").write_text(json.dumps(run.cfg, indent=2) + "\n")
    log_.update(steps=run.step, total_steps=run.total, **sizes, seconds=round(time.time() - t0, 1),
                settings=asdict(s), loss_curve=run.curve, held_out=metrics)
    (out / "gpu_training.json").write_text(json.dumps(log_, indent=1) + "\n")
