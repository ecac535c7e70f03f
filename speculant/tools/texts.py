"""Text for batched training (tools/train_batched.py): prompts, the target's own answers to them,
and the files that hold them.

- ``sharegpt_prompts``: chat-templated ShareGPT prompts in groups (first turns, longer first turns,
  second user turns, the first turns a feature cache already answered);
- ``task_prompts``: short task prompts built from ShareGPT's text (translate a sentence of a reply,
  summarize or answer questions on a passage of one, explain or fix its code) and made-up arithmetic
  word problems: the shapes of the bench's categories, none of the bench's text;
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
import random
import re
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


TASK_SIZES = {"T": 2048, "Q": 1024, "M": 1024, "W": 1024, "K": 2048, "R": 2048, "S": 2048}

_LANGUAGES = ["French"] * 3 + ["German"] * 3 + ["Spanish"] * 3 + ["Italian", "Portuguese"]
_TRANSLATE = ["Translate to {lang}: {text}", "Translate the following sentence into {lang}:\n\n{text}",
              "Translate this into {lang}:\n{text}", "How would you say this in {lang}? \"{text}\""]
_SUMMARIZE = ["{text}\n\nSummarize the text above in two sentences.", "Summarize the following text in one sentence:\n\n{text}",
              "Summarize:\n\n{text}", "{text}\n\nWrite a short summary of this text.",
              "{text}\n\nWhat are the main points of this text? Give three bullet points.",
              "Give a brief summary of the passage below.\n\n{text}"]
_PASSAGE = ["Passage: {text}\n\nQuestion: {q}", "Passage: {text}\n\nQuestion: {q}\nAnswer using only the passage.",
            "Read the text and answer the question.\n\nText: {text}\n\nQuestion: {q}",
            "Context:\n{text}\n\nUsing only the context above, answer: {q}"]
_PASSAGE_QUESTIONS = ["What is the main idea of the passage?", "Which points does the passage make? List them briefly.",
                      "According to the passage, what should be done first?", "What example does the passage give?",
                      "Does the passage mention any risks or drawbacks? Answer briefly."]
_CODE_TASKS = ["Explain what this code does.", "Find the bug in this code and fix it.", "Add comments to this code.",
               "Rewrite this code so that it is easier to read.", "Write a short docstring for this code.",
               "Suggest two improvements to this code.", "Rename the variables in this code to clearer names."]
_CODE = ["{task}\n\n```{lang}\n{code}\n```", "Here is some {Lang} code:\n\n{code}\n\n{task}",
         "```{lang}\n{code}\n```\n\n{task}", "Look at this code:\n\n{code}\n\n{task}"]
_NAMES = ["Maya", "Omar", "Priya", "Jonas", "Chen", "Sofia", "Kwame", "Elena", "Tariq", "Hana", "Diego", "Ruth"]
_MATH = [  # (problem, numbers drawn for a, b, c); made up here
    ("{n} bakes {a} muffins in the morning and {b} in the afternoon. She sells {c} of them. How many muffins are left?",
     (20, 60), (10, 40), (5, 30)),
    ("A bus leaves with {a} passengers. At the first stop {b} get off and {c} get on. How many passengers are on the bus now?",
     (20, 50), (3, 19), (2, 15)),
    ("{n} reads {a} pages a day. How many pages does {n} read in {b} days, and how many are left of a {c}-page book?",
     (8, 30), (3, 9), (300, 500)),
    ("A shop sells pencils at {a} cents each. {n} buys {b} pencils and pays with a {c}-dollar bill. How much change does {n} get?",
     (15, 60), (3, 12), (10, 20)),
    ("A garden has {a} rows of tomato plants with {b} plants in each row. {c} plants die. How many plants are left?",
     (4, 12), (6, 15), (2, 10)),
    ("{n} saves {a} dollars a week. How many weeks does it take to save {b} dollars? Also, how much is saved after {c} weeks?",
     (5, 25), (100, 300), (3, 8)),
    ("A train travels at {a} km per hour for {b} hours and then at {c} km per hour for 2 hours. How far does it travel in total?",
     (40, 90), (2, 5), (50, 100)),
    ("{n} has {a} marbles and gives a third of them to a friend, then finds {b} more. How many marbles does {n} have now?",
     (30, 90), (2, 12), (0, 0)),
    ("A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?", (5, 30), (3, 20), (0, 0)),
    ("There are {a} students in a class. {b} percent of them walk to school and the rest take the bus. How many take the bus?",
     (20, 40), (10, 60), (0, 0)),
]
_MATH_ASK = ["Think step by step, then give the final answer.", "Show your work step by step.",
             "Explain your reasoning before giving the answer.", ""]


def _english(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.98 * len(text)


def _prose(paragraph: str) -> bool:
    """A paragraph of plain English sentences: no code, no list, no heading, no table."""
    p = paragraph.strip()
    return (_english(p) and "```" not in p and "|" not in p and "\n" not in p and not re.match(r"([-*#>]|\d+[.)])", p)
            and p.count(". ") >= 1 and p[-1:] in ".!?")


def _passages(reply: str, lo: int = 300, hi: int = 1600) -> list[str]:
    """Runs of consecutive prose paragraphs of a reply, each run lo..hi characters."""
    out, run = [], []
    for p in reply.split("\n\n") + [""]:
        if p and _prose(p):
            run.append(p.strip())
            if len("\n\n".join(run)) >= lo:
                text = "\n\n".join(run)
                if len(text) <= hi:
                    out.append(text)
                run = []
        else:
            run = []
    return out


def _made_up_problem(rng: random.Random) -> str:
    text, *spans = rng.choice(_MATH)
    a, b, c = (rng.randint(*s) for s in spans)
    if "a third" in text:
        a -= a % 3
    if "percent" in text:
        b -= b % 10
        a -= a % 10
    ask = rng.choice(_MATH_ASK)
    return text.format(n=rng.choice(_NAMES), a=a, b=b, c=c) + (" " + ask if ask else "")


def task_prompts(tokenizer, skip: int = 0, sizes: dict[str, int] | None = None, max_tokens: int = 512,
                 seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Chat-templated task prompts (<= ``max_tokens``) built from ShareGPT's text (after its first
    ``skip`` conversations), in groups of at most ``sizes`` (default ``TASK_SIZES``), each drawn at
    random from all the candidates: T translate a sentence or two of a reply; Q short first-turn
    questions; M made-up arithmetic word problems; W short first turns asking for code; K a code
    block of a reply to explain, fix, comment, rename or document; R a passage of a reply and the
    conversation's question (or a general one) about it; S a passage of a reply to summarize."""
    sizes = dict(TASK_SIZES if sizes is None else sizes)
    rng = random.Random(seed)
    found = {k: [] for k in "TQWKRS"}
    for n, conv in enumerate(sharegpt_conversations()):
        if n < skip:
            continue
        user = conv[0]["content"].strip()
        short_user = _english(user) and len(user) <= 300 and "\n" not in user
        if short_user and 12 <= len(user) <= 160 and user.endswith("?"):
            found["Q"].append(user)
        if short_user and re.search(r"\b(write|create|implement)\b", user, re.I) and \
                re.search(r"\b(function|code|script|program|class|query|regex)\b", user, re.I):
            found["W"].append(user)
        for m in conv[1:]:
            if m["role"] != "assistant":
                continue
            reply = m["content"]
            for lang, code in re.findall(r"```(\w*)\n(.*?)```", reply, re.S):
                lines = code.rstrip().split("\n")
                if 3 <= len(lines) <= 40 and len(code) <= 1500 and _english(code):
                    found["K"].append((lang.lower(), code.rstrip()))
            for text in _passages(reply):
                found["S"].append(text)
                found["R"].append((text, user if short_user and user.endswith("?") else None))
            for p in reply.split("\n\n"):
                if _prose(p):
                    sents = re.split(r"(?<=[.!?])\s+", p.strip())
                    i = rng.randrange(len(sents))
                    for k in (2, 1):
                        text = " ".join(sents[i : i + k])
                        if 40 <= len(text) <= 240:
                            found["T"].append(text)
                            break

    def make(name: str, item) -> str:
        if name == "T":
            return rng.choice(_TRANSLATE).format(lang=rng.choice(_LANGUAGES), text=item)
        if name in "QW":
            return item
        if name == "K":
            lang, code = item
            names = {"py": "Python", "js": "JavaScript", "ts": "TypeScript", "cpp": "C++", "csharp": "C#", "": "this"}
            Lang = names.get(lang, lang.capitalize() if lang.isalpha() else "this")
            return rng.choice(_CODE).format(task=rng.choice(_CODE_TASKS), lang=lang, Lang=Lang, code=code)
        if name == "R":
            text, q = item
            return rng.choice(_PASSAGE).format(text=text, q=q if q and rng.random() < 0.7 else rng.choice(_PASSAGE_QUESTIONS))
        return rng.choice(_SUMMARIZE).format(text=item)

    groups = {}
    for name in sizes:
        if name == "M":
            pool = (_made_up_problem(rng) for _ in range(20 * sizes[name]))
        else:
            items = list(dict.fromkeys(found[name])) if name in "QWS" else found[name]
            rng.shuffle(items)
            pool = (make(name, x) for x in items)
        groups[name], seen = [], set()
        for text in pool:
            if len(groups[name]) >= sizes[name]:
                break
            if text in seen:
                continue
            seen.add(text)
            ids = encode_prompt(tokenizer, text, max_tokens)
            if ids:
                groups[name].append(torch.tensor(ids, dtype=torch.int32).to(torch.uint16))
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
