"""``speculant train``: a drafter trained on the target's own hidden states, in the speculators format.

Stages, each cached in ``OUT.work/`` (delete it to start over; ``--resume`` picks up any stage):
1. features: conversations -> (self-distilled) text -> the target's tapped hidden states and its
   next-token choices (data.py), in shards;
2. a draft vocabulary: the N tokens the target produces most often in that text (EAGLE-3, FR-Spec):
   the drafter's LM head covers only those, q is zero elsewhere (still lossless);
3. training: random anchors in each answer, each a block [token, MASK, ...] the drafter fills in
   one forward; cross-entropy against the target's choices, slot j weighted exp(-(j-1)/4) (DFlash's
   decay), AdamW with warm-up and cosine decay, checkpoints every ``--checkpoint-every`` steps;
4. evaluation on held-out sequences: per anchor, how many slots in a row match the target (the
   accepted run under greedy verification), so α per slot and τ = 1 + mean run;
5. the folder: config.json + model.safetensors (bf16), loadable as ``--drafter KIND:OUT`` (or ``trained:OUT``) and by
   speculators / vLLM, plus ``speculant_training.json`` (command, data, time, metrics).
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
import torch.nn.functional as F

from ..errors import SpeculantError, check_writable
from .data import (Example, Features, encode_conversation, encode_prompt, jsonl_records, self_distilled_features,
                   sharegpt_conversations, text_features)
from .dflash import DFlashNet
from .format import default_taps, dflash_config, save_folder
from .eagle import EagleNet, EagleTrainer, eagle_config
from .medusa import MedusaNet, medusa_config

KINDS = ("dflash", "eagle", "medusa")


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
    if s.kind not in KINDS:
        raise SpeculantError(f"unknown drafter kind {s.kind!r}: use one of {', '.join(KINDS)}")
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


def pick_mask_token(tokenizer, vocab: int) -> int:
    """A token the text never uses, as the block's MASK: an 'unused' token if the vocabulary has one,
    else the last added special token that is not BOS/EOS/PAD/UNK or a chat-template marker."""
    if tokenizer is None:
        return vocab - 1
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    unused = sorted(i for i, t in added.items() if "unused" in str(t))
    if unused:
        return unused[0]
    template = str(getattr(tokenizer, "chat_template", "") or "")
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    free = [i for i, t in added.items() if i not in taken and str(t) not in template and i < vocab]
    return max(free) if free else vocab - 1


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
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


class GreedyRuns:
    """Held-out acceptance of a drafter's top-1 guesses under greedy verification: per slot, how
    often its guess is the target's token given the slots before it were right (α), and τ = 1 +
    the mean run of right guesses."""

    def __init__(self, slots: int, d2t: torch.Tensor | None):
        self.reached, self.accepted, self.runs, self.d2t = torch.zeros(slots), torch.zeros(slots), [], d2t

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits [N, slots, V or draft V], the target's tokens [N, slots]."""
        pick = logits.argmax(-1)
        if self.d2t is not None:
            pick = pick + self.d2t.to(pick.device)[pick]
        self.add_picks(pick, labels)

    def add_picks(self, pick: torch.Tensor, labels: torch.Tensor) -> None:
        """The drafter's guesses as target ids [N, slots], the target's tokens [N, slots]."""
        match = (pick.to(labels.device) == labels).long()
        run = match.cumprod(1).sum(1)
        self.runs += run.tolist()
        for j in range(match.shape[1]):
            alive = run >= j
            self.reached[j] += alive.sum()
            self.accepted[j] += (alive & (match[:, j] == 1)).sum()

    def result(self, unit: str) -> dict:
        alpha = (self.accepted / self.reached.clamp_min(1)).tolist()
        return {"tau": 1 + sum(self.runs) / max(1, len(self.runs)), "alpha_by_slot": [round(a, 3) for a in alpha],
                unit: len(self.runs)}


class DFlashTrainer:
    """The loss and the held-out evaluation of a DFlash network on cached features."""

    def __init__(self, net: DFlashNet, embed, target_head, vocab: int, anchors: int, decay: float = 4.0):
        self.net, self.embed, self.target_head, self.vocab = net, embed, target_head, vocab
        self.anchors, self.decay = anchors, decay
        K = net.block_size
        self.weights = torch.exp(-torch.arange(K - 1, dtype=torch.float32) / decay)
        self.to_draft = _to_draft(net.d2t, vocab) if net.draft_vocab else None

    def _blocks(self, f: Features, anchors: int, rng: random.Random):
        K, T = self.net.block_size, len(f.ids)
        first = max(f.loss_from - 1, 0)
        candidates = list(range(first, T - K + 1))
        if not candidates:
            return None
        chosen = sorted(rng.sample(candidates, min(anchors, len(candidates))))
        return torch.tensor(chosen)

    def forward(self, f: Features, anchors: torch.Tensor):
        """Logits [A, K-1, V or draft V] of every anchor's block, and the target's choices [A, K-1]."""
        net, K = self.net, self.net.block_size
        dev = net.fc.weight.device
        T, A = len(f.ids), len(anchors)
        ctx = net.context(f.hidden[None].to(dev))
        kv = net.context_kv(ctx, torch.arange(T, device=dev)[None])
        kv = [(k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1)) for k, v in kv]
        steps = torch.arange(K)
        positions = (anchors[:, None] + steps[None]).to(dev)
        block = torch.full((A, K), net.mask_token_id, dtype=torch.long)
        block[:, 0] = f.ids[anchors]
        sees = torch.cat([torch.arange(T)[None] < anchors[:, None], torch.ones(A, K, dtype=torch.bool)], 1)
        hidden = net.block(self.embed(block.to(dev)).detach(), positions, kv, sees[:, None, None].to(dev))
        h = hidden[:, 1:].contiguous()  # a strided slice would make a frozen head a bmm over A copies of it
        logits = net.lm_head(h) if net.draft_vocab else self.target_head(h)
        labels = f.labels[(anchors[:, None] + steps[None, 1:] - 1)]  # slot j: the target's choice after a+j-1
        return logits.float(), labels.to(dev)

    def loss(self, f: Features, rng: random.Random):
        anchors = self._blocks(f, self.anchors, rng)
        if anchors is None:
            return None, 0
        logits, labels = self.forward(f, anchors)
        targets = labels if self.to_draft is None else self.to_draft.to(labels.device)[labels]
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        w = self.weights.to(per.device).repeat(len(anchors)) * (targets.flatten() != -100)
        return (per * w).sum() / w.sum().clamp_min(1e-6), len(anchors) * (self.net.block_size - 1)

    @torch.no_grad()
    def evaluate(self, features: list[Features], rng: random.Random) -> dict:
        """α per slot and τ = 1 + mean accepted run (greedy verification of each block)."""
        runs = GreedyRuns(self.net.block_size - 1, self.net.d2t if self.net.draft_vocab else None)
        for f in features:
            anchors = self._blocks(f, 64, rng)
            if anchors is not None:
                runs.add(*self.forward(f, anchors))
        return runs.result("blocks")


class MedusaTrainer:
    """The loss and the held-out evaluation of Medusa heads on cached features: head j at position
    t learns the target's token t+2+j (labels[t+1+j]), weighted 0.8^j as Medusa does."""

    def __init__(self, net: MedusaNet, target_head, vocab: int):
        self.net, self.target_head, self.vocab = net, target_head, vocab
        K = net.num_heads
        self.weights = 0.8 ** torch.arange(K, dtype=torch.float32)
        self.to_draft = _to_draft(net.d2t, vocab) if net.draft_vocab else None

    def forward(self, f: Features):
        """Logits [T', K, V or draft V] of the answer's positions and the target's tokens there [T', K]
        (-100 past the sequence's end)."""
        K, T = self.net.num_heads, len(f.ids)
        first = max(f.loss_from - 1, 0)
        t = torch.arange(first, T - 1)
        dev = self.net.heads[0][0].linear.weight.device
        states = self.net(f.final[first : T - 1].to(dev).float())
        logits = self.net.lm_head(states) if self.net.draft_vocab else self.target_head(states)
        at = t[:, None] + 1 + torch.arange(K)[None]
        labels = torch.where(at < T, f.labels[at.clamp(max=T - 1)], torch.full_like(at, -100))
        return logits.float(), labels.to(dev)

    def loss(self, f: Features, rng: random.Random):
        if len(f.ids) - max(f.loss_from - 1, 0) < 2:
            return None, 0
        logits, labels = self.forward(f)
        targets = labels if self.to_draft is None else torch.where(
            labels >= 0, self.to_draft.to(labels.device)[labels.clamp_min(0)], labels)
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        w = self.weights.to(per.device).repeat(logits.shape[0]) * (targets.flatten() != -100)
        return (per * w).sum() / w.sum().clamp_min(1e-6), logits.shape[0]

    @torch.no_grad()
    def evaluate(self, features: list[Features], rng: random.Random) -> dict:
        """Per head, α = how often its top-1 guess is the target's token, given the heads before it
        were right; τ = 1 + mean run of right guesses (the greedy chain of top-1 guesses; the tree
        the drafter offers does better)."""
        runs = GreedyRuns(self.net.num_heads, self.net.d2t if self.net.draft_vocab else None)
        for f in features:
            if len(f.ids) - max(f.loss_from - 1, 0) >= 2:
                runs.add(*self.forward(f))
        return runs.result("positions")


def _to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Target id -> draft index (-100: not in the draft vocabulary, ignored by the loss)."""
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t.cpu()
    to_draft[ids] = torch.arange(d2t.shape[0])
    return to_draft


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
    from ..models.loading import resolve_device

    if resolve_device(device).type == "cuda":
        return "bfloat16"
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    return "bfloat16" if native() else "float32"


def mixed_precision(device: str | None, dtype: str = "auto"):
    """bfloat16 autocast where the target's features are bfloat16 (``feature_dtype``: a GPU, or a CPU
    with native bf16 matmuls): the drafter's weights and optimiser stay float32."""
    from ..models.loading import resolve_device

    enabled = feature_dtype(dtype, device) == "bfloat16"
    return torch.autocast(resolve_device(device).type, torch.bfloat16, enabled=enabled)


def run_train(s: TrainSettings, progress_bar: bool = True, log=print) -> dict:
    check_settings(s)
    from ..models.loading import forget_loaded, load_model

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
        d2t, t2d = draft_vocabulary(train, s.draft_vocab, vocab)
        draft_size = s.draft_vocab if d2t is not None else vocab
        cfg, net, trainer = _network(s, target, taps, draft_size, d2t, t2d)
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0, betas=(0.9, 0.95))
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
                lr = s.lr * min(1.0, (step + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
                for group in opt.param_groups:
                    group["lr"] = lr
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
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()}
    save_folder(out, cfg, state)
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
    """(config, network, trainer) of the kind to train. The draft-vocabulary LM head starts as the
    target's own rows for those tokens (Medusa, EAGLE), EAGLE's final norm as the target's."""
    model = target.model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    head, name = model.get_output_embeddings(), str(_verifier_path(s.target))
    if s.kind == "dflash":
        cfg = dflash_config(model, name, s.layers, taps, s.block_size, pick_mask_token(target.tokenizer, vocab),
                            draft_size)
        net = DFlashNet(cfg)
    elif s.kind == "eagle":
        cfg = eagle_config(model, name, taps, draft_size, s.ttt_steps, s.layers)
        net = EagleNet(cfg)
    else:
        cfg = medusa_config(model, name, s.heads, s.layers, draft_size)
        net = MedusaNet(cfg)
    net = net.to(target.device)
    with torch.no_grad():
        if d2t is not None:
            net.d2t.copy_(d2t)
            net.t2d.copy_(t2d)
        if s.kind in ("eagle", "medusa") and net.lm_head is not None:
            rows = torch.arange(net.lm_head.weight.shape[0]) + (d2t if d2t is not None else 0)
            net.lm_head.weight.copy_(head.weight[rows])
        final_norm = getattr(getattr(model, "model", None), "norm", None)
        if s.kind == "eagle" and final_norm is not None:  # its effective scale, whatever its convention (Gemma: 1 + w)
            ones = torch.ones(1, net.norm.weight.shape[0], device=final_norm.weight.device, dtype=final_norm.weight.dtype)
            net.norm.weight.copy_(final_norm(ones).squeeze(0).float())
    if s.kind == "dflash":
        trainer = DFlashTrainer(net, model.get_input_embeddings(), head, vocab, s.anchors)
    elif s.kind == "eagle":
        trainer = EagleTrainer(net, model.get_input_embeddings(), head, s.ttt_steps)
    else:
        trainer = MedusaTrainer(net, head, vocab)
    return cfg, net, trainer


def _verifier_path(spec: str) -> Path:
    """The target as a Hugging Face folder (a GGUF's dequantised cache), for the config's verifier."""
    from ..models.loading import resolve_model_folder

    return resolve_model_folder(spec)[0]
