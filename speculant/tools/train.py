"""``speculant train``: a drafter trained on the target's own hidden states, in the speculators format.

Stages, each cached in ``OUT.work/`` (delete it to start over; ``--resume`` picks up any stage):
1. features: conversations -> (self-distilled) text -> the target's tapped hidden states and its
   next-token choices (trained/data.py; self-distilled: tools/distill.py), in shards;
2. a draft vocabulary: the N tokens the target produces most often in that text (EAGLE-3, FR-Spec):
   the drafter's LM head covers only those, q is zero elsewhere (still lossless);
3. training (each kind's network and trainer: trained/KIND.py, through the registry's TrainedKind),
   e.g. DFlash: random anchors in each answer, each a block [token, MASK, ...] the drafter fills in
   one forward; cross-entropy against the target's choices, slot j weighted exp(-(j-1)/4) (DFlash's
   decay), AdamW with warm-up and cosine decay, checkpoints every ``--checkpoint-every`` steps;
4. evaluation on held-out sequences: per anchor, how many slots in a row match the target (the
   accepted run under greedy verification), so α per slot and τ = 1 + mean run;
5. the folder: config.json + model.safetensors (bf16), loadable as ``--drafter KIND:OUT`` (or ``trained:OUT``) and by
   speculators / vLLM, plus ``speculant_training.json`` (command, data, time, metrics).

This is the feature-cache mode (tools/features.py), one sequence at a time (right for a CPU); the
batched mode (tools/train_batched.py: the target's states computed on the fly for right-padded
batches, on a GPU) continues a folder of any kind. Both run the one loop of tools/trainer.py with
their own data, and drive every kind's trainer through one interface:
``loss(features, rng)`` on one cached sequence, ``loss_batch(ids, aux, final, loss_from, lengths,
labels, rng)`` on right-padded sequences (``loss`` is ``loss_batch`` on a batch of one), each
returning (loss or None, units learnt), and ``evaluate(held-out features, rng)``. A kind's own
settings (``--layers``, ``--heads``, ...) are its registry entry's ``options`` (drafters/spec.py's
TrainOption): ``TrainSettings.options`` holds those given, ``kind_options`` all of them.
"""
from __future__ import annotations

import functools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..drafters.registry import TRAIN_OPTIONS, TRAINED
from ..drafters.spec import TrainedKind
from ..errors import SpeculantError, check_writable
from ..models.loading import forget_loaded, load_model, resolve_model_folder
from ..trained.data import Features, jsonl_records
from ..trained.format import default_taps, save_folder
from .features import DISTILL_BATCH, SHARD_ITEMS, build_features, load_features  # noqa: F401 (their home was here)
from .trainer import (LoopSettings, Progress, Run, adamw, bf16_state, draft_vocabulary, evaluate_held_out,  # noqa: F401
                      feature_dtype, mixed_precision, resume, set_lr, train_loop)


@dataclass
class TrainSettings(LoopSettings):
    """``speculant train``'s settings: the loop's (LoopSettings; ``work`` holds the feature cache
    too, OUT.work by default), the feature cache's, the kind's own."""

    kind: str = "eagle"
    target: str = "default"
    data: str = "sharegpt"
    out: str = ""
    max_tokens: int = 200_000  # feature tokens (prompt + answer) to build
    conversations: int | None = None  # cap on conversations read
    self_distill: bool = True
    answer_tokens: int = 256  # self-distilled answer length
    seq_len: int = 640
    draft_vocab: int = 8192
    taps: list[int] | None = None
    eval_sequences: int = 32
    checkpoint_every: int = 100
    device: str | None = None
    dtype: str = "auto"  # the target's while building features (feature_dtype)
    overwrite: bool = False
    # the kind's own settings given (its TrainedKind.options: layers, heads, ...); the rest at their defaults
    options: dict = field(default_factory=dict)


def kind_options(kind: TrainedKind, given: dict) -> SimpleNamespace:
    """The kind's own settings, for its hooks: each given one, else its default (others' ignored)."""
    return SimpleNamespace(**{o.name: given.get(o.name, o.default) for o in kind.options})


def check_settings(s: TrainSettings) -> None:
    """Bad input, before any model work: one line each."""
    if s.kind not in TRAINED:
        raise SpeculantError(f"unknown drafter kind {s.kind!r}: use one of {', '.join(sorted(TRAINED))}")
    if TRAINED[s.kind].train_refusal:
        raise SpeculantError(TRAINED[s.kind].train_refusal)
    _check_out(s)
    if s.data != "sharegpt":
        next(jsonl_records(s.data))  # an empty or malformed file fails here
    for name in ("max_tokens", "answer_tokens", "seq_len", "batch", "eval_sequences", "steps", "checkpoint_every",
                 "draft_vocab", "conversations"):  # None: not given
        if getattr(s, name) is not None and getattr(s, name) < 1:
            raise SpeculantError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    _check_options(s.options)
    if s.epochs <= 0:
        raise SpeculantError(f"--epochs must be > 0, got {s.epochs}")
    if not s.lr > 0:
        raise SpeculantError(f"--lr must be > 0, got {s.lr}")


def _check_out(s: TrainSettings) -> None:
    if not s.out:
        raise SpeculantError("--out DIR is required: the folder the trained drafter is written to")
    out = Path(s.out)
    if out.exists() and not (s.overwrite or s.resume):
        raise SpeculantError(f"output folder '{out}' exists: pass --overwrite to replace it (or --resume)")
    if out.exists() and not out.is_dir():
        raise SpeculantError(f"output path '{out}' is a file, not a folder")
    if out.resolve() in (Path.cwd(), *Path.cwd().parents):
        raise SpeculantError(f"--out '{out}' is the current folder or one above it: give the drafter a folder of its own")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        # --overwrite replaces the folder whole: never a folder of other things (`--out .`)
        raise SpeculantError(f"output folder '{out}' holds files and is not a drafter folder: give a new or a "
                             "drafter folder to --out (--overwrite replaces the whole folder)")
    check_writable(out, beside=True)


def _check_options(given: dict) -> None:
    """Each kind option given is one some kind declares, at or above its minimum (whatever the kind:
    a bad value is a mistake even where this kind ignores it)."""
    for name, value in given.items():
        if name not in TRAIN_OPTIONS:
            raise SpeculantError(f"unknown training option {name!r}: the kinds take {', '.join(sorted(TRAIN_OPTIONS))}")
        option = TRAIN_OPTIONS[name][0][1]
        if value < option.minimum:
            why = f" ({option.why})" if option.why else ""
            raise SpeculantError(f"--{name.replace('_', '-')} must be >= {option.minimum}{why}, got {value}")


def check_architecture(kind: str, model) -> None:
    """A drafter kind needs a decoder-only target whose config describes Llama-like layers (the
    drafter's layers copy their shape) and whose input/output embeddings it can share."""
    cfg = model.config
    missing = [k for k in NEEDS if getattr(cfg, k, None) is None]
    if missing or model.get_output_embeddings() is None:
        name = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
        raise SpeculantError(f"--kind {kind} cannot be trained for a {name} target: its config lacks "
                             f"{', '.join(missing) or 'an output embedding'} (speculant trains drafters for "
                             "Llama-like decoders: Llama, Qwen, Mistral, Gemma, ...)")


NEEDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "rms_norm_eps")  # what the drafters' layers copy from the target's config


class CachedFeatures:
    """The loop's data in the feature-cache mode: ``batch`` cached sequences a step, each sequence's
    loss back-propagated as it comes (a step with no loss at all still counts)."""

    def __init__(self, train: list[Features], batch: int, device: str | None, dtype: str):
        self.train, self.batch = train, batch
        self.order = list(range(len(train)))
        self.amp = mixed_precision(device, dtype)  # one autocast context, entered for each forward

    def epoch(self, rng: random.Random):
        rng.shuffle(self.order)
        for start in range(0, len(self.order), self.batch):
            yield self.order[start : start + self.batch]

    def backward(self, trainer, batch: list[int], rng: random.Random) -> tuple[list[float], int]:
        losses, tokens = [], 0
        for i in batch:
            with self.amp:
                loss, n = trainer.loss(self.train[i], rng)
            if loss is not None:
                (loss / self.batch).backward()
                losses.append(float(loss.detach()))
                tokens += n
        return losses, tokens


def run_train(s: TrainSettings, progress_bar: bool = True, log=print) -> dict:
    """``speculant train``: features cached, a network of the kind trained on them, its folder written."""
    check_settings(s)
    t0 = time.time()
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    target = load_model(s.target, device=s.device, dtype=feature_dtype(s.dtype, s.device))
    check_architecture(s.kind, target.model)
    target.model.requires_grad_(False)  # the target (its embeddings and LM head included) stays frozen
    taps = _taps(s, target.model.config.num_hidden_layers)
    out = Path(s.out)
    work = Path(s.work) if s.work else out.parent / f"{out.name}.work"
    progress = Progress(progress_bar)
    try:
        features = _features(s, target, taps, work, progress)
        rng.shuffle(features)
        held = features[: min(s.eval_sequences, max(1, len(features) // 10))]
        train = features[len(held):] or features
        run = _new_run(s, target, taps, train, work)
        if s.resume:
            resume(run, s.kind, log)
        run.started = time.time()
        evaluate = functools.partial(evaluate_held_out, run.net, run.trainer, held, s.device, s.dtype)

        def on_eval(run: Run, metrics: dict, info: str) -> str:
            info += f", held-out τ {metrics['tau']:.2f}"
            progress.note(f"step {run.step}/{run.total}: {info}; checkpoint {run.checkpoint}")
            return info

        train_loop(run, CachedFeatures(train, s.batch, s.device, s.dtype), rng, lr=s.lr, warmup=s.warmup,
                   every=s.checkpoint_every, evaluate=evaluate, on_eval=on_eval, progress=progress)
        metrics = evaluate()
    finally:
        progress.close()
    save_folder(out, run.cfg, bf16_state(run.net))
    summary = _summary(s, run, train, held, features, metrics, t0)
    (out / "speculant_training.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"speculant train: wrote {out} ({summary['parameters'] / 1e6:.1f} M parameters); held-out τ "
        f"{metrics['tau']:.2f}, α by slot {metrics['alpha_by_slot']} in {summary['seconds'] / 60:.1f} min")
    return summary


def _taps(s: TrainSettings, n_layers: int) -> list[int]:
    taps = s.taps or default_taps(n_layers)
    if any(t < 0 or t > n_layers for t in taps):
        raise SpeculantError(f"--taps must be layer ids in 0..{n_layers} for this target, got {taps}")
    return taps


def _features(s: TrainSettings, target, taps: list[int], work: Path, progress: Progress) -> list[Features]:
    """The cached features at the drafter's taps, with the final normed state apart; the target is
    left as the drafter's float32 neighbour."""
    # one target pass records the drafter's taps and the final normed state (Medusa's input,
    # the distillation targets), for every kind alike, so kinds share one cache
    n_layers = target.model.config.num_hidden_layers
    feature_taps = sorted(set(taps) | {n_layers})
    features = load_features(build_features(s, target, feature_taps, work, progress))
    for f in features:  # copies: the cached tensor with every tap is freed
        f.final = f.hidden[:, feature_taps.index(n_layers)].clone()
        f.hidden = f.hidden[:, [feature_taps.index(t) for t in taps]]
    forget_loaded(target)  # later loads in this process get the target in the dtype they ask for
    target.model.float()  # the drafter keeps float32 weights beside the frozen target (bf16 autocast: mixed_precision)
    return features


def _new_run(s: TrainSettings, target, taps: list[int], train: list[Features], work: Path) -> Run:
    """A fresh network of the kind, over the draft vocabulary of the training answers."""
    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    d2t, t2d = draft_vocabulary(train, s.draft_vocab, vocab) if TRAINED[s.kind].draft_vocab else (None, None)
    draft_size = s.draft_vocab if d2t is not None else vocab
    options = kind_options(TRAINED[s.kind], s.options)
    cfg, net, trainer = new_network(TRAINED[s.kind], s.target, options, target, taps, draft_size, d2t, t2d)
    opt = adamw([p for p in net.parameters() if p.requires_grad], s.lr)
    total = s.steps or max(1, math.ceil(s.epochs * len(train) / s.batch))
    return Run(net, trainer, opt, cfg, total, checkpoint=work / f"checkpoint-{s.kind}.pt")


def _summary(s: TrainSettings, run: Run, train, held, features, metrics: dict, t0: float) -> dict:
    """speculant_training.json: what was trained, on what, how long, how well."""
    settings = {k: v for k, v in asdict(s).items() if k != "options"} | vars(kind_options(TRAINED[s.kind], s.options))
    return {"kind": s.kind, "target": s.target, "data": s.data, "settings": settings, "steps": run.step,
            "train_sequences": len(train), "held_out_sequences": len(held),
            "feature_tokens": sum(len(f.ids) for f in features), "seconds": round(time.time() - t0, 1),
            "held_out": metrics, "parameters": sum(p.numel() for p in run.net.parameters()),
            "loss_curve": run.curve,
            "command": " ".join(["speculant"] + sys.argv[1:]) if sys.argv and "speculant" in sys.argv[0] else None}


def new_network(kind: TrainedKind, target_spec: str, options, target, taps: list[int], draft_size: int, d2t, t2d):
    """(config, network, trainer) of the kind to train (its hooks: the registry's TrainedKind;
    ``options``: its own settings). A draft-vocabulary LM head starts as the target's own rows for
    those tokens (Medusa, EAGLE), EAGLE's final norm as the target's."""
    cfg = kind.training_config(target, str(_verifier_path(target_spec)), options, taps, draft_size)
    net = kind.network(cfg).to(target.device)
    with torch.no_grad():
        if d2t is not None:
            net.d2t.copy_(d2t)
            net.t2d.copy_(t2d)
        if kind.init_from_target is not None:
            kind.init_from_target(net, target, d2t)
    return cfg, net, kind.trainer(net, target, options)


def _verifier_path(spec: str) -> Path:
    """The target as a Hugging Face folder (a GGUF's dequantised cache), for the config's verifier."""
    return resolve_model_folder(spec)[0]
