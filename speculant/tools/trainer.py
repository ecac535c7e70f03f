"""The one training loop every mode of training drives, with its data pluggable.

A mode gives the loop its data: an object with ``epoch(rng)`` (one pass over its batches, in an
order drawn from ``rng``) and ``backward(trainer, batch, rng)`` (the losses of one batch computed
and back-propagated: (their values, units learnt), or None for a batch with nothing to learn, which
takes no step). Two do: the feature cache (``CachedFeatures`` in tools/train.py: one cached
sequence at a time, on a CPU) and the target's states on the fly for padded batches
(``TappedBatches`` in tools/train_batched.py, on a GPU). The loop is the same for both: AdamW with
linear warm-up and cosine decay, gradients clipped to norm 1, an evaluation (and a checkpoint,
where the run has a checkpoint file) every ``every`` steps and at the last; ``resume`` continues
from that checkpoint. What a run needs beyond that (a time budget, files of its own) it hooks in:
``on_step`` after every step, ``on_eval`` with each evaluation.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import SpeculantError
from ..models.loading import resolve_device


@dataclass
class LoopSettings:
    """What every mode's settings give the loop (each mode's type adds its data's and may change a
    default)."""

    steps: int | None = None  # optimizer steps (default: epochs over the data)
    epochs: float = 1.0
    batch: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    warmup: int = 50  # steps of linear warm-up before the cosine decay
    seed: int = 0
    work: str | None = None  # where checkpoints go (speculant train: the feature cache too)
    resume: bool = False  # continue from the checkpoint in ``work``


@dataclass
class Run:
    """A training run: its network, trainer and optimiser, where it stands (``on_step`` may lower
    ``total``) and what it has learnt so far."""

    net: torch.nn.Module
    trainer: object  # the kind's: loss, loss_batch, evaluate
    opt: torch.optim.Optimizer
    cfg: dict  # the network's folder config (a checkpoint of another shape is refused)
    total: int  # steps
    checkpoint: Path | None = None  # written with each evaluation; None: no checkpoints
    step: int = 0
    curve: list[float] = field(default_factory=list)  # each step's mean loss
    tokens: int = 0  # units learnt
    started: float = field(default_factory=time.time)  # when the steps began

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]


def train_loop(run: Run, data, rng: random.Random, *, lr: float, warmup: int, every: int, evaluate: Callable,
               on_eval: Callable, on_step: Callable | None = None, progress: Progress | None = None) -> None:
    """Steps ``run`` to ``run.total`` on ``data``'s batches. ``evaluate()`` gives held-out metrics
    every ``every`` steps and at the last; ``on_eval(run, metrics, info)`` follows each (after the
    checkpoint) and returns the progress line's ``info`` (the step's loss and rate) with what it adds."""
    progress = progress or Progress(False)
    progress.stage("training (steps)", run.total)
    if run.step:
        progress.advance("training (steps)", run.step)
    while run.step < run.total:
        for batch in data.epoch(rng):
            if run.step >= run.total:
                break
            set_lr(run.opt, lr, run.step, warmup, run.total)
            run.opt.zero_grad()
            learnt = data.backward(run.trainer, batch, rng)
            if learnt is None:  # nothing to learn in this batch: no step
                continue
            losses, tokens = learnt
            torch.nn.utils.clip_grad_norm_(run.params, 1.0)
            run.opt.step()
            run.step += 1
            run.tokens += tokens
            run.curve.append(round(sum(losses) / max(1, len(losses)), 4))
            if on_step is not None:
                on_step(run)
            rate = run.tokens / max(1e-9, time.time() - run.started)
            info = f"loss {sum(losses) / max(1, len(losses)):.3f}, {rate:.0f} tok/s"
            if run.step % every == 0 or run.step == run.total:
                metrics = evaluate()
                save_checkpoint(run)
                info = on_eval(run, metrics, info)
            progress.advance("training (steps)", 1, info, done=run.step)


def evaluate_held_out(net: torch.nn.Module, trainer, held: list, device: str | None, dtype: str) -> dict:
    """The trainer's held-out metrics (the same draws each time), the network in eval mode meanwhile."""
    net.eval()
    with mixed_precision(device, dtype):
        metrics = trainer.evaluate(held, random.Random(1))
    net.train()
    return metrics


def save_checkpoint(run: Run) -> None:
    if run.checkpoint is not None:
        torch.save({"config": run.cfg, "net": run.net.state_dict(), "opt": run.opt.state_dict(), "step": run.step},
                   run.checkpoint)


def resume(run: Run, kind: str, log) -> None:
    """``run`` from its checkpoint, where there is one: the network, the optimiser and the step."""
    if run.checkpoint is None or not run.checkpoint.is_file():
        return
    state = torch.load(run.checkpoint, weights_only=False)
    if state["config"] != run.cfg:  # starting over would overwrite that run's checkpoint
        raise SpeculantError(f"--resume: the checkpoint {run.checkpoint} is of a differently shaped {kind} drafter "
                             "(other --layers, --draft-vocab, --taps, ... or target): resume with its "
                             "settings, or give another --work folder")
    run.net.load_state_dict(state["net"])
    run.opt.load_state_dict(state["opt"])
    run.step = state["step"]
    log(f"speculant train: resumed at step {run.step}/{run.total} from {run.checkpoint}")


def adamw(params, lr: float) -> torch.optim.Optimizer:
    """The drafters' optimiser (every mode of training)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, lr: float, step: int, warmup: int, total: int) -> None:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at step ``total``."""
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))


def bf16_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The network's weights as a folder keeps them: floating point in bfloat16."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()}


def feature_dtype(dtype: str, device: str | None) -> str:
    """The target's dtype while building features: ``auto`` is bfloat16 on a GPU or a CPU with
    native bf16 matmuls (AVX512-BF16 / AMX: several times faster there), else float32."""
    if dtype != "auto":
        return dtype
    if resolve_device(device).type == "cuda":
        return "bfloat16"
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    return "bfloat16" if native() else "float32"


def mixed_precision(device: str | None, dtype: str = "auto"):
    """bfloat16 autocast where the target's features are bfloat16 (``feature_dtype``: a GPU, or a CPU
    with native bf16 matmuls): the drafter's weights and optimiser stay float32."""
    enabled = feature_dtype(dtype, device) == "bfloat16"
    return torch.autocast(resolve_device(device).type, torch.bfloat16, enabled=enabled)


def draft_vocabulary(features: list, size: int, vocab: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d2t offsets, t2d mask) of the ``size`` tokens the target chooses most in the answers
    (speculators' convention: target id = draft index + d2t[draft index]); None for the full vocabulary."""
    if size >= vocab:
        return None, None
    counts = torch.zeros(vocab, dtype=torch.long)
    for f in features:
        answer = f.labels[max(f.loss_from - 1, 0) :].clamp(0, vocab - 1)
        counts.index_add_(0, answer, torch.ones_like(answer))
    order = torch.argsort(counts + torch.arange(vocab, 0, -1) * 1e-9, descending=True)  # ties: lower ids first
    chosen = order[:size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(size), t2d


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():  # rich's progress bar: only on a terminal (it takes a while to import)
            from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.bar.start()
        self.tasks = {}
        self.enabled = enabled
        self.last = 0.0

    def stage(self, name: str, total: int):
        if self.bar is not None:
            self.tasks[name] = self.bar.add_task(name, total=total, info="")
        elif self.enabled:
            print(f"speculant train: {name} ({total})", file=sys.stderr, flush=True)

    def advance(self, name: str, n: int = 1, info: str = "", done: int | None = None):
        if self.bar is not None:
            self.bar.update(self.tasks[name], advance=n, info=info)
        elif self.enabled and time.time() - self.last > 30:
            self.last = time.time()
            print(f"speculant train: {name} {done if done is not None else ''} {info}", file=sys.stderr, flush=True)

    def note(self, line: str):
        """A line worth keeping (a checkpoint), printed even with --no-progress (a bar shows its loss
        and τ already)."""
        if self.bar is None:
            print(f"speculant train: {line}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
