"""Text for batched training (tools/train_batched.py): prompts, the target's own answers to them,
and the files that hold them.

- ``sharegpt_prompts``: chat-templated ShareGPT prompts in groups (first turns, longer first turns,
  second user turns, the first turns a feature cache already answered);
- ``self_instruct``: prompts the target writes itself (Magpie, Xu et al. 2024);
- ``distill``: the target answers prompts in left-padded batches (HF ``generate``: greedy, or
  sampled for chosen groups);
- ``texts_from_cache``: the texts of a `speculant train` feature cache (prompt + self-distilled answer).

Text files: a list of (token ids uint16 [T], answer start) pairs (``torch.save``), or parts packed by
``save_texts(copy_to=...)``; prompt files a dict of named lists of prompt ids (uint16).
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..trained.data import _ids, encode_prompt, sharegpt_conversations

_log = functools.partial(print, flush=True)


def save_texts(texts: list, path, copy_to=None, part_tokens: int = 6_000_000) -> None:
    """``texts`` [(ids uint16, answer start)] to ``path``; with ``copy_to``, also packed flat in
    parts of at most ``part_tokens`` tokens (12 MB: the GPU machine returns files of 16 MiB at most)."""
    torch.save(texts, path)
    if not copy_to:
        return
    Path(copy_to).mkdir(parents=True, exist_ok=True)
    part, count, k = [], 0, 0
    for item in texts + [None]:
        if item is None or count + len(item[0]) > part_tokens:
            torch.save({"flat": torch.cat([x for x, _ in part]), "lengths": torch.tensor([len(x) for x, _ in part]),
                        "loss_from": torch.tensor([lf for _, lf in part])}, Path(copy_to) / f"{Path(path).stem}-{k}.pt")
            part, count, k = [], 0, k + 1
        if item is not None:
            part.append(item)
            count += len(item[0])


def load_texts(path) -> list:
    """A file of ``save_texts``: the list itself, or a packed part."""
    obj = torch.load(path)
    if isinstance(obj, dict):
        return [(x, int(lf)) for x, lf in zip(obj["flat"].split(obj["lengths"].tolist()), obj["loss_from"])]
    return obj


def texts_from_cache(cache) -> list:
    """The texts of a `speculant train` feature cache (its work folder): prompt + self-distilled answer."""
    texts = []
    for manifest in sorted(Path(cache).glob("features-*/features.json")):
        for shard in json.loads(manifest.read_text())["shards"]:
            for d in torch.load(manifest.parent / shard["name"], weights_only=False):
                full = torch.cat([d["ids"], d["labels"][-1:]])  # features stop one token before the end
                texts.append((full.to(torch.int32).to(torch.uint16), int(d["loss_from"])))
    return texts


def pad_id(target) -> int:
    """The id padding rows of a batched ``generate``: the tokenizer's, else an end-of-text id."""
    tok = target.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else min(target.eos_token_ids)


def sharegpt_prompts(tokenizer, skip: int = 0) -> dict[str, list[torch.Tensor]]:
    """Chat-templated ShareGPT prompts in groups: A first turns of <= 384 tokens (after the first
    ``skip`` of them, which `speculant train`'s cache already answered), B first turns of
    385..896 tokens, C second user turns (with the conversation's own replies before them) of
    <= 896 tokens, D the skipped first turns (for a sampled second answer)."""

    def templated(msgs):
        return torch.tensor(_ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)),
                            dtype=torch.int32).to(torch.uint16)

    groups, first_turns = {"A": [], "B": [], "C": [], "D": []}, 0
    for conv in sharegpt_conversations():
        msgs = [m for m in conv if isinstance(m.get("content"), str)]
        if not msgs:
            continue
        first = templated(msgs[:1])
        if 0 < len(first) <= 384:
            first_turns += 1
            groups["D" if first_turns <= skip else "A"].append(first)
        elif len(first) <= 896:
            groups["B"].append(first)
        users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
        if len(users) >= 2 and all(m["role"] in ("user", "assistant") for m in msgs[: users[1] + 1]):
            second = templated(msgs[: users[1] + 1])
            if len(second) <= 896:
                groups["C"].append(second)
    return groups


def self_instruct(target, count: int = 2000, batch: int = 128, query_tokens: int = 128, temperature: float = 1.0,
                  top_p: float = 0.95, min_chars: int = 12, minutes: float | None = None, seed: int = 0,
                  log=_log) -> list[torch.Tensor]:
    """Prompts the target (a LoadedModel) writes itself (Magpie): sampled from its chat template's
    opening of a user turn, each up to the end of that turn. They follow the target's own
    instruction-tuning mix (short tasks: rewrite, explain, code, math) where ShareGPT holds long
    chats; chat-templated, for ``distill``. Stops at ``count``, after ``minutes``, or after five
    batches with no new whole turn."""
    model, tok = target.model, target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise SpeculantError(f"self-instruct needs a chat template; {target.name} has none: use `prompts` (ShareGPT)")
    mark = "QUERY-3f9c"  # where the user's words go
    turn = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head, tail = turn.split(mark)
    opening = torch.tensor([tok(head, add_special_tokens=False)["input_ids"]], device=target.device)
    stops = set(target.eos_token_ids) | set(tok(tail, add_special_tokens=False)["input_ids"][:1])
    pad = pad_id(target)
    torch.manual_seed(seed)
    found, t0, barren = {}, time.time(), 0
    while len(found) < count and barren < 5 and not (minutes and time.time() - t0 > minutes * 60):
        with torch.no_grad():
            ids = opening.expand(batch, -1)
            rows = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                                  top_p=top_p, top_k=0, max_new_tokens=query_tokens,
                                  eos_token_id=sorted(stops), pad_token_id=pad)[:, opening.shape[1]:].tolist()
        before = len(found)
        for row in rows:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            text = tok.decode(row[:end], skip_special_tokens=True).strip() if end is not None else ""
            if len(text) >= min_chars and text not in found and len(found) < count:  # whole turns only
                found[text] = encode_prompt(tok, text, query_tokens + opening.shape[1] + 64)
        barren = barren + 1 if len(found) == before else 0
        log(f"self-instruct {len(found)}/{count} {time.time() - t0:.0f}s")
    return [torch.tensor(ids, dtype=torch.int32).to(torch.uint16) for ids in found.values() if ids]


def distill(target, groups: dict[str, list[torch.Tensor]], names: list[str], out, sampled: tuple[str, ...] = (),
            temperature: float = 0.7, batch: int = 512, answer_tokens: int = 256, copy_to=None,
            minutes: float | None = None, seed: int = 0, log=_log) -> list:
    """The target (a LoadedModel) answers the prompts of groups ``names`` (shortest first, in
    left-padded batches; greedily, or sampled at ``temperature`` for the groups in ``sampled``): the
    texts prompt + answer (up to its end of text, kept), saved to ``out`` every five batches and at
    the end (``save_texts``)."""
    model = target.model
    pad = pad_id(target)
    texts, t0 = [], time.time()
    torch.manual_seed(seed)
    for name in names:
        prompts = sorted((x.to(torch.int32) for x in groups[name]), key=len)
        kw = dict(do_sample=True, temperature=temperature) if name in sampled else \
            dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        for start in range(0, len(prompts), batch):
            if minutes and time.time() - t0 > minutes * 60:
                break
            chunk = prompts[start : start + batch]
            L = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros(len(chunk), L, dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: every row's answer starts at column L
                ids[i, L - len(p):] = p.long()
                mask[i, L - len(p):] = 1
            with torch.no_grad():
                gen = model.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                                     max_new_tokens=answer_tokens, eos_token_id=sorted(target.eos_token_ids),
                                     pad_token_id=pad, **kw)[:, L:].cpu()
            for p, g in zip(chunk, gen):
                ends = [j for j, t in enumerate(g.tolist()) if t in target.eos_token_ids]
                answer = g[: ends[0] + 1] if ends else g
                texts.append((torch.cat([p, answer.to(torch.int32)]).to(torch.uint16), len(p)))
            if (start // batch) % 5 == 4:
                save_texts(texts, out, copy_to)
            log(f"distill {name} {start + len(chunk)}/{len(prompts)} {time.time() - t0:.0f}s "
                f"{sum(len(x) for x, _ in texts)} tokens")
    save_texts(texts, out, copy_to)
    return texts
