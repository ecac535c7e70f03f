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

This is the feature-cache mode, one sequence at a time (right for a CPU); the batched mode
(tools/train_batched.py: the target's states computed on the fly for right-padded batches, on a
GPU) continues a folder of any kind. Both drive every kind's trainer through one interface:
``loss(features, rng)`` on one cached sequence, ``loss_batch(ids, aux, final, loss_from, lengths,
labels, rng)`` on right-padded sequences (``loss`` is ``loss_batch`` on a batch of one), each
returning (loss or None, units learnt), and ``evaluate(held-out features, rng)``.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafters.registry import TRAINED
from ..errors import SpeculantError, check_writable
from ..models.loading import forget_loaded, load_model, resolve_device, resolve_model_folder
from ..trained.data import (Example, Features, encode_conversation, encode_prompt, jsonl_records,
                            sharegpt_conversations, text_features)
from ..trained.format import default_taps, save_folder
from .distill import self_distilled_features


@dataclass
class TrainSettings:
    kind: str = "eagle"
    target: str = "default"
    data: str = "sharegpt"
    out: str = ""
    steps: int | None = None
    epochs: float = 1.0
    max_tokens: int = 200_000  # feature tokens (prompt + answer) to build
    conversations: int | None = None  # cap on conversations read
    self_distill: bool = True
    answer_tokens: int = 256  # self-distilled answer length
    seq_len: int = 640
    layers: int = 1  # dflash: decoder layers; medusa: residual blocks per head
    block_size: int = 8
    heads: int = 4  # medusa: tokens guessed beyond the next one
    ttt_steps: int = 3  # eagle: training-time-test steps (the drafter fed its own states)
    work: str | None = None  # the cache folder (features, checkpoints); default OUT.work
    draft_vocab: int = 8192
    taps: list[int] | None = None
    anchors: int = 48  # per sequence and step
    batch: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    warmup: int = 50
    eval_sequences: int = 32
    checkpoint_every: int = 100
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"  # the target's while building features (feature_dtype)
    resume: bool = False
    overwrite: bool = False
    extra: dict = field(default_factory=dict)


def check_settings(s: TrainSettings) -> None:
    """Bad input, before any model work: one line each."""
    if s.kind not in TRAINED:
        raise SpeculantError(f"unknown drafter kind {s.kind!r}: use one of {', '.join(sorted(TRAINED))}")
    if TRAINED[s.kind].train_refusal:
        raise SpeculantError(TRAINED[s.kind].train_refusal)
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
    if s.data != "sharegpt":
        next(jsonl_records(s.data))  # an empty or malformed file fails here
    for name in ("max_tokens", "answer_tokens", "seq_len", "layers", "anchors", "batch", "eval_sequences", "heads",
                 "ttt_steps", "steps", "checkpoint_every", "draft_vocab", "conversations"):  # None: not given
        if getattr(s, name) is not None and getattr(s, name) < 1:
            raise SpeculantError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if s.block_size < 2:
        raise SpeculantError(f"--block-size must be >= 2 (the anchor and at least one draft), got {s.block_size}")
    if s.epochs <= 0:
        raise SpeculantError(f"--epochs must be > 0, got {s.epochs}")
    if not s.lr > 0:
        raise SpeculantError(f"--lr must be > 0, got {s.lr}")


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


def build_features(s: TrainSettings, target, taps, work: Path, progress: Progress) -> list[Path]:
    """Shards of Features in ``work``, at least ``s.max_tokens`` target tokens of them.

    The cache grows: a manifest written after every shard records its token count, so an
    interrupted run resumes where it stopped, and a run asking for fewer tokens than the cache
    holds (the same data and settings otherwise) takes a prefix of it instead of starting over."""
    key = {k: getattr(s, k) for k in ("target", "data", "conversations", "self_distill", "answer_tokens", "seq_len",
                                      "dtype")} | {"taps": list(taps)}
    if s.data != "sharegpt":  # the user's file: rebuilt when it changes
        stat = Path(s.data).stat()
        key["data_file"] = [stat.st_size, stat.st_mtime_ns]
    # one folder per set of settings: a run with other settings never touches another's cache
    work = work / ("features-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10])
    manifest = work / "features.json"
    kept = json.loads(manifest.read_text()) if manifest.is_file() else {}
    shards = kept.get("shards", [])
    tokens = sum(sh["tokens"] for sh in shards)
    if tokens >= s.max_tokens or (shards and kept.get("exhausted")):
        return _prefix(work, shards, s.max_tokens)
    work.mkdir(parents=True, exist_ok=True)
    done_items = sum(sh["items"] for sh in shards)
    tok = target.tokenizer
    records = ({"messages": c} for c in sharegpt_conversations(s.conversations)) if s.data == "sharegpt" \
        else jsonl_records(s.data)
    progress.stage("features (target tokens)", s.max_tokens)
    if tokens:
        progress.advance("features (target tokens)", tokens, "resumed", done=tokens)
    prompt_limit = max(16, s.seq_len - s.answer_tokens)

    def usable(rec) -> list[int] | Example | None:
        """The prompt (self-distilled) or the example this record gives, None if it gives none."""
        if "text" in rec:
            ids = tok(rec["text"])["input_ids"][: s.seq_len] if tok is not None else None
            return _example(ids, 0) if ids and len(ids) > 8 else None
        msgs = [m for m in rec["messages"] if isinstance(m.get("content"), str)]
        if s.self_distill:
            return encode_prompt(tok, msgs[0]["content"], prompt_limit) if msgs else None
        return encode_conversation(tok, msgs, s.seq_len)

    def save(items: list, found: int) -> None:
        """One shard of the features of ``found`` usable records; the manifest follows it."""
        nonlocal tokens
        feats = text_features(target, [i for i in items if isinstance(i, Example)], taps)
        # the target answers a shard's prompts in batches of similar lengths
        prompts = sorted((i for i in items if not isinstance(i, Example)), key=len)
        for i in range(0, len(prompts), DISTILL_BATCH):
            feats += self_distilled_features(target, prompts[i : i + DISTILL_BATCH], taps, s.answer_tokens)
        n = sum(len(f.ids) for f in feats)
        path = work / f"features-{len(shards):04d}.pt"
        torch.save([asdict(f) for f in feats], path)
        shards.append({"name": path.name, "tokens": n, "items": found})
        tokens += n
        manifest.write_text(json.dumps({"key": key, "shards": shards}))
        progress.advance("features (target tokens)", n, done=tokens)

    def size(item) -> int:
        """The tokens an item gives (a prompt's answer counted whole: it may stop sooner)."""
        return len(item.ids) if isinstance(item, Example) else len(item) + s.answer_tokens

    # a shard closes at SHARD_ITEMS records or once it holds what is still asked for, so a small
    # --max-tokens does not build (and train on) a whole shard of long conversations
    pending, pending_tokens, skip = [], 0, done_items
    for rec in records:
        if tokens >= s.max_tokens:
            break
        item = usable(rec)
        if item is None:
            continue
        if skip:  # already in a kept shard
            skip -= 1
            continue
        pending.append(item)
        pending_tokens += size(item)
        if len(pending) == SHARD_ITEMS or tokens + pending_tokens >= s.max_tokens:
            save(pending, len(pending))
            pending, pending_tokens = [], 0
    if pending and tokens < s.max_tokens:
        save(pending, len(pending))
    exhausted = tokens < s.max_tokens
    if not shards:
        raise SpeculantError(f"no usable training sequences in {s.data!r} (all empty or longer than --seq-len)")
    manifest.write_text(json.dumps({"key": key, "shards": shards, "exhausted": exhausted}))
    return _prefix(work, shards, s.max_tokens)


SHARD_ITEMS = 256  # records per shard (the unit of resuming)
DISTILL_BATCH = 64  # prompts the target answers at once (batched decoding pays on a CPU too)


def _prefix(work: Path, shards: list[dict], max_tokens: int) -> list[Path]:
    """The first shards that together hold at least ``max_tokens`` tokens (all, if they hold fewer)."""
    out, total = [], 0
    for sh in shards:
        if total >= max_tokens:
            break
        out.append(work / sh["name"])
        total += sh["tokens"]
    return out


def _example(ids, loss_from):
    return Example(list(ids), loss_from)


def load_features(shards: list[Path]) -> list[Features]:
    return [Features(**d) for p in shards for d in torch.load(p, weights_only=False)]


def draft_vocabulary(features: list[Features], size: int, vocab: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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


NEEDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "rms_norm_eps")  # what the drafters' layers copy from the target's config


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


def adamw(params, lr: float) -> torch.optim.Optimizer:
    """The drafters' optimiser (both modes of training)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, lr: float, step: int, warmup: int, total: int) -> None:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at step ``total``."""
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))


def bf16_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The network's weights as a folder keeps them: floating point in bfloat16."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()}


def run_train(s: TrainSettings, progress_bar: bool = True, log=print) -> dict:
    check_settings(s)
    t0 = time.time()
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    target = load_model(s.target, device=s.device, dtype=feature_dtype(s.dtype, s.device))
    model = target.model
    check_architecture(s.kind, model)
    model.requires_grad_(False)  # the target (its embeddings and LM head included) stays frozen
    n_layers = model.config.num_hidden_layers
    taps = s.taps or default_taps(n_layers)
    if any(t < 0 or t > n_layers for t in taps):
        raise SpeculantError(f"--taps must be layer ids in 0..{n_layers} for this target, got {taps}")
    out = Path(s.out)
    work = Path(s.work) if s.work else out.parent / f"{out.name}.work"
    progress = Progress(progress_bar)
    try:
        # one target pass records the drafter's taps and the final normed state (Medusa's input,
        # the distillation targets), for every kind alike, so kinds share one cache
        feature_taps = sorted(set(taps) | {n_layers})
        features = load_features(build_features(s, target, feature_taps, work, progress))
        for f in features:  # copies: the cached tensor with every tap is freed
            f.final = f.hidden[:, feature_taps.index(n_layers)].clone()
            f.hidden = f.hidden[:, [feature_taps.index(t) for t in taps]]
        forget_loaded(target)  # later loads in this process get the target in the dtype they ask for
        model.float()  # the drafter keeps float32 weights beside the frozen target (bf16 autocast: mixed_precision)
        rng.shuffle(features)
        held = features[: min(s.eval_sequences, max(1, len(features) // 10))]
        train = features[len(held):] or features
        vocab = int(model.get_output_embeddings().weight.shape[0])
        d2t, t2d = draft_vocabulary(train, s.draft_vocab, vocab) if TRAINED[s.kind].draft_vocab else (None, None)
        draft_size = s.draft_vocab if d2t is not None else vocab
        cfg, net, trainer = _network(s, target, taps, draft_size, d2t, t2d)
        params = [p for p in net.parameters() if p.requires_grad]
        opt = adamw(params, s.lr)
        total = s.steps or max(1, math.ceil(s.epochs * len(train) / s.batch))
        step, ckpt = 0, work / f"checkpoint-{s.kind}.pt"
        amp = mixed_precision(s.device, s.dtype)  # one autocast context, entered for each forward
        if s.resume and ckpt.is_file():
            state = torch.load(ckpt, weights_only=False)
            if state["config"] != cfg:  # starting over would overwrite that run's checkpoint
                raise SpeculantError(f"--resume: the checkpoint {ckpt} is of a differently shaped {s.kind} drafter "
                                     "(other --layers, --draft-vocab, --taps, ... or target): resume with its "
                                     "settings, or give another --work folder")
            net.load_state_dict(state["net"])
            opt.load_state_dict(state["opt"])
            step = state["step"]
            log(f"speculant train: resumed at step {step}/{total} from {ckpt}")
        progress.stage("training (steps)", total)
        if step:
            progress.advance("training (steps)", step)
        seen_tokens, t_train, metrics, curve = 0, time.time(), {}, []
        order = list(range(len(train)))
        while step < total:
            rng.shuffle(order)
            for start in range(0, len(order), s.batch):
                if step >= total:
                    break
                set_lr(opt, s.lr, step, s.warmup, total)
                opt.zero_grad()
                losses = []
                for i in order[start : start + s.batch]:
                    with amp:
                        loss, n = trainer.loss(train[i], rng)
                    if loss is not None:
                        (loss / s.batch).backward()
                        losses.append(float(loss.detach()))
                        seen_tokens += n
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                curve.append(round(sum(losses) / max(1, len(losses)), 4))
                rate = seen_tokens / max(1e-9, time.time() - t_train)
                info = f"loss {sum(losses) / max(1, len(losses)):.3f}, {rate:.0f} tok/s"
                if step % s.checkpoint_every == 0 or step == total:
                    with amp:
                        metrics = trainer.evaluate(held, random.Random(1))
                    info += f", held-out τ {metrics['tau']:.2f}"
                    torch.save({"config": cfg, "net": net.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
                    progress.note(f"step {step}/{total}: {info}; checkpoint {ckpt}")
                progress.advance("training (steps)", 1, info, done=step)
        with amp:
            metrics = trainer.evaluate(held, random.Random(1))
    finally:
        progress.close()
    save_folder(out, cfg, bf16_state(net))
    summary = {"kind": s.kind, "target": s.target, "data": s.data, "settings": asdict(s), "steps": step,
               "train_sequences": len(train), "held_out_sequences": len(held),
               "feature_tokens": sum(len(f.ids) for f in features), "seconds": round(time.time() - t0, 1),
               "held_out": metrics, "parameters": sum(p.numel() for p in net.parameters()),
               "loss_curve": curve,
               "command": " ".join(["speculant"] + sys.argv[1:]) if sys.argv and "speculant" in sys.argv[0] else None}
    (out / "speculant_training.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"speculant train: wrote {out} ({summary['parameters'] / 1e6:.1f} M parameters); held-out τ "
        f"{metrics['tau']:.2f}, α by slot {metrics['alpha_by_slot']} in {summary['seconds'] / 60:.1f} min")
    return summary


def _network(s: TrainSettings, target, taps: list[int], draft_size: int, d2t, t2d):
    """(config, network, trainer) of the kind to train (its hooks: the registry's TrainedKind). A
    draft-vocabulary LM head starts as the target's own rows for those tokens (Medusa, EAGLE),
    EAGLE's final norm as the target's."""
    kind = TRAINED[s.kind]
    cfg = kind.training_config(target, str(_verifier_path(s.target)), s, taps, draft_size)
    net = kind.network(cfg).to(target.device)
    with torch.no_grad():
        if d2t is not None:
            net.d2t.copy_(d2t)
            net.t2d.copy_(t2d)
        if kind.init_from_target is not None:
            kind.init_from_target(net, target, d2t)
    return cfg, net, kind.trainer(net, target, s)


def _verifier_path(spec: str) -> Path:
    """The target as a Hugging Face folder (a GGUF's dequantised cache), for the config's verifier."""
    return resolve_model_folder(spec)[0]
