"""The feature cache of ``speculant train``: conversations -> (self-distilled) text -> the target's
tapped hidden states and its next-token choices (trained/data.py; self-distilled: tools/distill.py),
in shards that a later run resumes, grows or takes a prefix of.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..trained.data import (Example, Features, encode_conversation, encode_prompt, jsonl_records,
                            sharegpt_conversations, text_features)
from .distill import self_distilled_features
from .trainer import Progress

SHARD_ITEMS = 256  # records per shard (the unit of resuming)
DISTILL_BATCH = 64  # prompts the target answers at once (batched decoding pays on a CPU too)


def build_features(s, target, taps, work: Path, progress: Progress) -> list[Path]:
    """Shards of Features in ``work``, at least ``s.max_tokens`` target tokens of them (``s``: the
    TrainSettings).

    The cache grows: a manifest written after every shard records its token count, so an
    interrupted run resumes where it stopped, and a run asking for fewer tokens than the cache
    holds (the same data and settings otherwise) takes a prefix of it instead of starting over."""
    key = _cache_key(s, taps)
    # one folder per set of settings: a run with other settings never touches another's cache
    work = work / ("features-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10])
    manifest = work / "features.json"
    kept = json.loads(manifest.read_text()) if manifest.is_file() else {}
    cache = _Shards(s, target, taps, work, key, kept.get("shards", []), progress)
    if cache.tokens >= s.max_tokens or (cache.shards and kept.get("exhausted")):
        return _prefix(work, cache.shards, s.max_tokens)
    work.mkdir(parents=True, exist_ok=True)
    progress.stage("features (target tokens)", s.max_tokens)
    if cache.tokens:
        progress.advance("features (target tokens)", cache.tokens, "resumed", done=cache.tokens)
    cache.fill(_records(s))
    if not cache.shards:
        raise SpeculantError(f"no usable training sequences in {s.data!r} (all empty or longer than --seq-len)")
    cache.write_manifest(exhausted=cache.tokens < s.max_tokens)
    return _prefix(work, cache.shards, s.max_tokens)


def _cache_key(s, taps) -> dict:
    """What the cached features depend on."""
    key = {k: getattr(s, k) for k in ("target", "data", "conversations", "self_distill", "answer_tokens", "seq_len",
                                      "dtype")} | {"taps": list(taps)}
    if s.data != "sharegpt":  # the user's file: rebuilt when it changes
        stat = Path(s.data).stat()
        key["data_file"] = [stat.st_size, stat.st_mtime_ns]
    return key


def _records(s):
    return ({"messages": c} for c in sharegpt_conversations(s.conversations)) if s.data == "sharegpt" \
        else jsonl_records(s.data)


class _Shards:
    """The shards of one cache folder, and the records that go into new ones."""

    def __init__(self, s, target, taps, work: Path, key: dict, shards: list[dict], progress: Progress):
        self.s, self.target, self.taps, self.work, self.key = s, target, taps, work, key
        self.shards, self.progress = shards, progress
        self.tokens = sum(sh["tokens"] for sh in shards)
        self.prompt_limit = max(16, s.seq_len - s.answer_tokens)

    def usable(self, rec) -> list[int] | Example | None:
        """The prompt (self-distilled) or the example this record gives, None if it gives none."""
        s, tok = self.s, self.target.tokenizer
        if "text" in rec:
            ids = tok(rec["text"])["input_ids"][: s.seq_len] if tok is not None else None
            return Example(list(ids), 0) if ids and len(ids) > 8 else None
        msgs = [m for m in rec["messages"] if isinstance(m.get("content"), str)]
        if s.self_distill:
            return encode_prompt(tok, msgs[0]["content"], self.prompt_limit) if msgs else None
        return encode_conversation(tok, msgs, s.seq_len)

    def size(self, item) -> int:
        """The tokens an item gives (a prompt's answer counted whole: it may stop sooner)."""
        return len(item.ids) if isinstance(item, Example) else len(item) + self.s.answer_tokens

    def fill(self, records) -> None:
        """New shards of the records after those in kept shards, until ``max_tokens``. A shard closes
        at SHARD_ITEMS records or once it holds what is still asked for, so a small --max-tokens does
        not build (and train on) a whole shard of long conversations."""
        want = self.s.max_tokens
        pending, pending_tokens, skip = [], 0, sum(sh["items"] for sh in self.shards)
        for rec in records:
            if self.tokens >= want:
                break
            item = self.usable(rec)
            if item is None:
                continue
            if skip:  # already in a kept shard
                skip -= 1
                continue
            pending.append(item)
            pending_tokens += self.size(item)
            if len(pending) == SHARD_ITEMS or self.tokens + pending_tokens >= want:
                self.save(pending)
                pending, pending_tokens = [], 0
        if pending and self.tokens < want:
            self.save(pending)

    def save(self, items: list) -> None:
        """One shard of the features of these usable records; the manifest follows it."""
        target, taps = self.target, self.taps
        feats = text_features(target, [i for i in items if isinstance(i, Example)], taps)
        # the target answers a shard's prompts in batches of similar lengths
        prompts = sorted((i for i in items if not isinstance(i, Example)), key=len)
        for i in range(0, len(prompts), DISTILL_BATCH):
            feats += self_distilled_features(target, prompts[i : i + DISTILL_BATCH], taps, self.s.answer_tokens)
        n = sum(len(f.ids) for f in feats)
        path = self.work / f"features-{len(self.shards):04d}.pt"
        torch.save([asdict(f) for f in feats], path)
        self.shards.append({"name": path.name, "tokens": n, "items": len(items)})
        self.tokens += n
        self.write_manifest()
        self.progress.advance("features (target tokens)", n, done=self.tokens)

    def write_manifest(self, **more) -> None:
        (self.work / "features.json").write_text(json.dumps({"key": self.key, "shards": self.shards, **more}))


def _prefix(work: Path, shards: list[dict], max_tokens: int) -> list[Path]:
    """The first shards that together hold at least ``max_tokens`` tokens (all, if they hold fewer)."""
    out, total = [], 0
    for sh in shards:
        if total >= max_tokens:
            break
        out.append(work / sh["name"])
        total += sh["tokens"]
    return out


def load_features(shards: list[Path]) -> list[Features]:
    return [Features(**d) for p in shards for d in torch.load(p, weights_only=False)]
