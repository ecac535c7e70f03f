"""Train the default target's EAGLE-3 head on a GPU: more text and more steps than a CPU affords.

`speculant train` builds a feature cache on disk and trains one sequence at a time: right for a
2-core CPU (the shipped head's first version took ~3 h there). On a GPU the target's forward is
nearly free, so this script computes the target's tapped states on the fly for a batch of
right-padded sequences per step (``EagleTrainer.loss_batch``), over more self-distilled text.
Sequence lengths are padded up to multiples of 128: every new shape cost ~0.4 s on an H100
(500 ms a step without buckets, ~70 ms with them, batch 16). ``--device cpu`` works too: on a CPU with
native bf16 matmuls (AMX) it trains under bf16 autocast at ~1,100 tokens/s (2 cores, batch 8).

How the shipped head was made (``speculant_training.json`` in its folder records the same):

  # on the CPU: the first head, and its feature cache of 7,168 self-distilled answers
  speculant train --kind eagle --target default --data sharegpt --max-tokens 2000000 \
      --work runs/default.work --out runs/eagle-default --epochs 2 --checkpoint-every 200
  python scripts/gpu_eagle.py from-cache --cache runs/default.work --out cpu16.pt --device cpu
  python scripts/gpu_eagle.py prompts --out prompts16.pt --skip 7168 --device cpu
  # on the GPU: the target answers the prompts the cache did not reach (groups A, C, B)
  python scripts/gpu_eagle.py distill --prompts prompts16.pt --groups A,C,B --out distilled.pt
  # and the head trains on both texts, from the CPU's head (791 steps, batch 16)
  python scripts/gpu_eagle.py train --data cpu16.pt distilled.pt --config runs/eagle-default \
      --init runs/eagle-default --out OUT --steps 791 --batch 16 --lr 3e-4 --warmup 50
  python scripts/gpu_eagle.py join --out OUT      # one model.safetensors: --drafter trained:OUT

``self-instruct`` writes prompts of the target's own (Magpie: sampled from the opening of a user
turn in its chat template), for ``distill --groups M``: closer to short instructions than ShareGPT's
chats. On the 2-core CPU: 1,607 prompts in 13.5 min (batch 128), their greedy answers (424k tokens)
in 11.4 min (batch 96).

Text files: a list of (token ids uint16 [T], answer start) pairs (``torch.save``), or parts
packed by ``--copy-to``; prompt files a dict of named lists of prompt ids. ``--target``
defaults to the embedded default target.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def _pad_id(target) -> int:
    """The id padding rows of a batched ``generate``: the tokenizer's, else an end-of-text id."""
    tok = target.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else min(target.eos_token_ids)


def distill(a) -> None:
    from speculant.models.loading import load_model

    target = load_model(a.target, device=a.device, dtype=a.dtype)
    model = target.model
    groups = torch.load(a.prompts)
    pad = _pad_id(target)
    out, t0 = [], time.time()
    torch.manual_seed(a.seed)
    for name in a.groups.split(","):
        prompts = sorted((x.to(torch.int32) for x in groups[name]), key=len)
        sampled = name in a.sampled.split(",")
        for start in range(0, len(prompts), a.batch):
            if a.minutes and time.time() - t0 > a.minutes * 60:
                break
            chunk = prompts[start : start + a.batch]
            L = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros(len(chunk), L, dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: every row's answer starts at column L
                ids[i, L - len(p):] = p.long()
                mask[i, L - len(p):] = 1
            kw = dict(do_sample=True, temperature=a.temperature) if sampled else \
                dict(do_sample=False, temperature=None, top_k=None, top_p=None)
            with torch.no_grad():
                gen = model.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                                     max_new_tokens=a.answer_tokens, eos_token_id=sorted(target.eos_token_ids),
                                     pad_token_id=pad, **kw)[:, L:].cpu()
            for p, g in zip(chunk, gen):
                ends = [j for j, t in enumerate(g.tolist()) if t in target.eos_token_ids]
                answer = g[: ends[0] + 1] if ends else g
                out.append((torch.cat([p, answer.to(torch.int32)]).to(torch.uint16), len(p)))
            if (start // a.batch) % 5 == 4:
                save_texts(out, a.out, a.copy_to)
            print(f"distill {name} {start + len(chunk)}/{len(prompts)} {time.time() - t0:.0f}s "
                  f"{sum(len(x) for x, _ in out)} tokens", flush=True)
    save_texts(out, a.out, a.copy_to)
    print(f"distilled {len(out)} sequences, {sum(len(x) for x, _ in out)} tokens in {time.time() - t0:.0f}s")


def prompts(a) -> None:
    """Chat-templated ShareGPT prompts in groups: A first turns of <= 384 tokens (after the first
    ``--skip`` of them, which `speculant train`'s cache already answered), B first turns of
    385..896 tokens, C second user turns (with the conversation's own replies before them) of
    <= 896 tokens, D the skipped first turns (for a sampled second answer)."""
    from speculant.models.loading import load_model
    from speculant.trained.data import _ids, sharegpt_conversations

    tok = load_model(a.target, device=a.device, dtype="float32").tokenizer

    def templated(msgs):
        return torch.tensor(_ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)),
                            dtype=torch.int32).to(torch.uint16)

    groups, first_turns = {"A": [], "B": [], "C": [], "D": []}, 0
    for conv in sharegpt_conversations():
        msgs = [m for m in conv if isinstance(m.get("content"), str)]
        if not msgs:
            continue
        first = templated(msgs[:1])
        if 0 < len(first) <= 384:
            first_turns += 1
            groups["D" if first_turns <= a.skip else "A"].append(first)
        elif len(first) <= 896:
            groups["B"].append(first)
        users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
        if len(users) >= 2 and all(m["role"] in ("user", "assistant") for m in msgs[: users[1] + 1]):
            second = templated(msgs[: users[1] + 1])
            if len(second) <= 896:
                groups["C"].append(second)
    torch.save(groups, a.out)
    print({k: len(v) for k, v in groups.items()})


def self_instruct(a) -> None:
    """Prompts the target writes itself (Magpie, Xu et al. 2024): sampled from its chat template's
    opening of a user turn, each up to the end of that turn. They follow the target's own
    instruction-tuning mix (short tasks: rewrite, explain, code, math) where ShareGPT holds long
    chats; saved as group M, chat-templated, for ``distill``."""
    from speculant.errors import SpeculantError
    from speculant.models.loading import load_model
    from speculant.trained.data import encode_prompt

    target = load_model(a.target, device=a.device, dtype=a.dtype)
    model, tok = target.model, target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise SpeculantError(f"self-instruct needs a chat template; {a.target} has none: use `prompts` (ShareGPT)")
    mark = "QUERY-3f9c"  # where the user's words go
    turn = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head, tail = turn.split(mark)
    opening = torch.tensor([tok(head, add_special_tokens=False)["input_ids"]], device=target.device)
    stops = set(target.eos_token_ids) | set(tok(tail, add_special_tokens=False)["input_ids"][:1])
    pad = _pad_id(target)
    torch.manual_seed(a.seed)
    found, t0, barren = {}, time.time(), 0
    while len(found) < a.count and barren < 5 and not (a.minutes and time.time() - t0 > a.minutes * 60):
        with torch.no_grad():
            ids = opening.expand(a.batch, -1)
            rows = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=a.temperature,
                                  top_p=a.top_p, top_k=0, max_new_tokens=a.query_tokens,
                                  eos_token_id=sorted(stops), pad_token_id=pad)[:, opening.shape[1]:].tolist()
        before = len(found)
        for row in rows:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            text = tok.decode(row[:end], skip_special_tokens=True).strip() if end is not None else ""
            if len(text) >= a.min_chars and text not in found and len(found) < a.count:  # whole turns only
                found[text] = encode_prompt(tok, text, a.query_tokens + opening.shape[1] + 64)
        barren = barren + 1 if len(found) == before else 0  # five batches with no new whole turn: stop
        print(f"self-instruct {len(found)}/{a.count} {time.time() - t0:.0f}s", flush=True)
    prompts = [torch.tensor(ids, dtype=torch.int32).to(torch.uint16) for ids in found.values() if ids]
    torch.save({"M": prompts}, a.out)
    print(f"{len(prompts)} prompts the target wrote")


def from_cache(a) -> None:
    """The texts of a `speculant train` feature cache (prompt + self-distilled answer)."""
    texts = []
    for manifest in sorted(Path(a.cache).glob("features-*/features.json")):
        for shard in json.loads(manifest.read_text())["shards"]:
            for d in torch.load(manifest.parent / shard["name"], weights_only=False):
                full = torch.cat([d["ids"], d["labels"][-1:]])  # features stop one token before the end
                texts.append((full.to(torch.int32).to(torch.uint16), int(d["loss_from"])))
    save_texts(texts, a.out)
    print(f"{len(texts)} texts, {sum(len(x) for x, _ in texts)} tokens")


def save_texts(texts, path, copy_to=None, part_tokens=6_000_000) -> None:
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


def _batches(seqs, batch: int, rng: random.Random):
    """Batches of sequences of similar length (less padding), in random order."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), rng.random()))
    chunks = [order[i : i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(chunks)
    return chunks


def _tapped(model, taps, n_layers, seqs, idx, seq_len, device):
    """Right-padded ids [B, T] (each sequence but its last token), the target's states at the taps
    [B, T, taps, H] and its final normed states [B, T, H], answer starts and lengths."""
    rows = [seqs[i][0][:seq_len + 1].long() for i in idx]
    T = -(-(max(len(r) for r in rows) - 1) // 128) * 128  # few shapes: each new one costs ~0.4 s on a GPU
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r) - 1] = r[:-1]
    ids = ids.to(device)
    with torch.no_grad():
        hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.stack([hs[t] for t in taps], 2)
    return (ids, aux, hs[n_layers], torch.tensor([seqs[i][1] for i in idx], device=device),
            torch.tensor([len(r) - 1 for r in rows], device=device), rows)


def train(a) -> None:
    from safetensors.torch import load_file, save_file

    from speculant.models.loading import load_model
    from speculant.trained.data import Features
    from speculant.trained.eagle import EagleNet, EagleTrainer
    from speculant.tools.train import TrainSettings, _network, draft_vocabulary, mixed_precision

    t0 = time.time()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    target = load_model(a.target, device=a.device, dtype=a.dtype)
    model = target.model
    model.requires_grad_(False)
    n_layers = model.config.num_hidden_layers
    shipped = json.loads((Path(a.config) / "config.json").read_text())
    taps = shipped["eagle_aux_hidden_state_layer_ids"]
    seqs = [s for f in a.data for s in load_texts(f) if len(s[0]) - s[1] >= 2]
    rng.shuffle(seqs)
    held, trainset = seqs[: a.held_out], seqs[a.held_out :]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    answers = [SimpleNamespace(labels=s[0][1:].long(), loss_from=s[1]) for s in trainset]
    d2t, t2d = draft_vocabulary(answers, shipped["draft_vocab_size"], vocab)
    s = TrainSettings(kind="eagle", target=a.target, ttt_steps=shipped["speculators_config"]["proposal_methods"][0]
                      ["speculative_tokens"], layers=shipped["transformer_layer_config"]["num_hidden_layers"])
    cfg, net, trainer = _network(s, target, taps, shipped["draft_vocab_size"], d2t, t2d)
    if a.init:  # continue a trained head (its draft vocabulary too)
        net.load_state_dict({k: v.to(a.device) for k, v in load_file(str(Path(a.init) / "model.safetensors")).items()},
                            strict=False)
        # the trainer's LM-head rows follow the draft vocabulary, which the loaded head replaced
        trainer = EagleTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), s.ttt_steps)
    net.float()
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(trainset) / a.batch)
    total, step, curve, log = a.steps or int(a.epochs * per_epoch), 0, [], {"evals": []}

    def held_features():
        """Held-out sequences as `speculant train` evaluates them."""
        out = []
        for i in range(len(held)):
            ids, aux, final, lf, n, rows = _tapped(model, taps, n_layers, held, [i], a.seq_len, a.device)
            k = int(n[0])  # without the bucket's padding
            out.append(Features(ids[0, :k], int(lf[0]), aux[0, :k], rows[0][1:], final[0, :k]))
        return out

    held_f = held_features()

    def evaluate(net_, trainer_) -> dict:
        net_.eval()
        with mixed_precision(a.device, a.dtype):
            m = trainer_.evaluate(held_f, random.Random(1))
        net_.train()
        return m

    # the shipped head on the same held-out text, for comparison
    ref = EagleNet(shipped).to(a.device)
    ref.load_state_dict({k: v.float() for k, v in load_file(str(Path(a.config) / "model.safetensors")).items()},
                        strict=False)
    log["shipped_held_out"] = evaluate(ref, EagleTrainer(ref, model.get_input_embeddings(),
                                                         model.get_output_embeddings(), 3))
    print("shipped head, held out:", log["shipped_held_out"], flush=True)
    del ref
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(metrics):
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()}
        # files come back from the GPU machine 16 MiB at most: the LM head apart
        save_file({"lm_head.weight": state.pop("lm_head.weight").contiguous()}, str(out / "lm_head.safetensors"))
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "rest.safetensors"))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        log.update(steps=step, total_steps=total, train_sequences=len(trainset), held_out_sequences=len(held),
                   train_tokens=sum(len(x) for x, _ in trainset), seconds=round(time.time() - t0, 1),
                   settings=vars(a), loss_curve=curve, held_out=metrics)
        (out / "gpu_training.json").write_text(json.dumps(log, indent=1) + "\n")

    t_train, budget = time.time(), (a.minutes or 0) * 60
    while step < total:
        for idx in _batches(trainset, a.batch, rng):
            if step >= total:
                break
            lr = a.lr * min(1.0, (step + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = lr
            ids, aux, final, lf, n, _ = _tapped(model, taps, n_layers, trainset, idx, a.seq_len, a.device)
            with mixed_precision(a.device, a.dtype):
                loss, rows = trainer.loss_batch(ids, aux, final, lf, n)
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
            if step == 45 and a.minutes and not a.steps:  # fit the schedule into the time budget
                per_step = (time.time() - t15) / 30
                fits = step + int((budget - (time.time() - t_train)) / per_step)
                if fits < total:
                    print(f"{per_step * 1000:.0f} ms/step: {total} steps do not fit {a.minutes} min; {fits}", flush=True)
                    total = fits
            if step % a.eval_every == 0 or step == total:
                m = evaluate(net, trainer)
                log["evals"].append({"step": step, "seconds": round(time.time() - t_train), **m})
                print(f"step {step}/{total} loss {curve[-1]:.3f} held-out τ {m['tau']:.3f} α {m['alpha_by_slot']} "
                      f"{time.time() - t_train:.0f}s", flush=True)
                save(m)
    m = evaluate(net, trainer)
    save(m)
    print(f"done: {step} steps, held-out τ {m['tau']:.3f} (shipped {log['shipped_held_out']['tau']:.3f}) "
          f"in {time.time() - t0:.0f}s")


def join(a) -> None:
    """``train`` writes the LM head apart (files come back from the GPU machine 16 MiB at most):
    one ``model.safetensors`` again, a drafter folder ``--drafter trained:DIR`` loads."""
    from safetensors.torch import load_file, save_file

    out = Path(a.out)
    state = load_file(str(out / "rest.safetensors")) | load_file(str(out / "lm_head.safetensors"))
    save_file({k: state[k].contiguous() for k in sorted(state)}, str(out / "model.safetensors"))
    for part in ("rest", "lm_head"):
        (out / f"{part}.safetensors").unlink()
    print(f"{out / 'model.safetensors'}: {len(state)} tensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("join").add_argument("--out", required=True, help="the folder ``train`` wrote")
    for name in ("prompts", "self-instruct", "from-cache", "distill", "train"):
        q = sub.add_parser(name)
        q.add_argument("--target", default="default")
        q.add_argument("--device", default="cuda")
        q.add_argument("--out", required=True)
        q.add_argument("--minutes", type=float, help="self-instruct/distill/train: stop within about this time")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--dtype", default="bfloat16", help="the target's (self-instruct, distill, train)")
    sub.choices["prompts"].add_argument("--skip", type=int, default=0)
    m = sub.choices["self-instruct"]
    m.add_argument("--count", type=int, default=2000, help="prompts to write (or what --minutes allows)")
    m.add_argument("--batch", type=int, default=128)
    m.add_argument("--query-tokens", type=int, default=128, help="longest user turn; longer ones are dropped")
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--top-p", type=float, default=0.95)
    m.add_argument("--min-chars", type=int, default=12)
    sub.choices["from-cache"].add_argument("--cache", required=True, help="a `speculant train` work folder")
    d = sub.choices["distill"]
    d.add_argument("--prompts", required=True)
    d.add_argument("--groups", default="A")
    d.add_argument("--sampled", default="", help="groups answered by sampling (the others greedily)")
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--batch", type=int, default=512)
    d.add_argument("--answer-tokens", type=int, default=256)
    d.add_argument("--copy-to", help="also write the text packed in parts of <= 12 MB here")
    t = sub.choices["train"]
    t.add_argument("--data", nargs="+", required=True)
    t.add_argument("--config", required=True, help="a drafter folder whose config to train (the shipped one)")
    t.add_argument("--init", help="a trained head's folder to continue from (its config and draft vocabulary)")
    t.add_argument("--epochs", type=float, default=8)
    t.add_argument("--steps", type=int, help="exactly this many steps (else --epochs, cut to fit --minutes)")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--seq-len", type=int, default=1152)
    t.add_argument("--held-out", type=int, default=64)
    t.add_argument("--eval-every", type=int, default=500)
    a = p.parse_args()
    stages = {"prompts": prompts, "self-instruct": self_instruct, "from-cache": from_cache, "distill": distill,
              "train": train, "join": join}
    from speculant.errors import SpeculantError

    try:
        stages[a.cmd](a)
    except SpeculantError as e:  # bad input: one line, exit 2, as the CLI does
        print(f"gpu_eagle.py {a.cmd}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
