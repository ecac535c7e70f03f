"""Train the default target's EAGLE-3 head on a GPU: more text and more steps than a CPU affords.

The command line of speculant.tools.train_batched (the target's tapped states computed on the fly
for a batch of right-padded sequences per step, the kind's ``loss_batch``; lengths padded to
multiples of 128) and speculant.tools.texts (prompts, the target's answers, text files), with what
only a run on the GPU machine needs: ``--minutes`` (steps 15 to 45 timed, the schedule cut to fit)
and the LM head written apart from the rest (that machine returns files of 16 MiB at most; ``join``
makes one ``model.safetensors`` of them again). ``train``
continues any trained kind's folder (``--config``: EAGLE, DFlash or Medusa); ``--device cpu`` works
too: on a CPU with native bf16 matmuls (AMX) EAGLE trains under bf16 autocast at ~1,100 tokens/s
(2 cores, batch 8).

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

``tasks`` writes task-shaped prompts built from ShareGPT's text (``texts.task_prompts``; the bench's
prompts stay held out): T translate a sentence or two of a reply, Q short questions, M made-up
arithmetic word problems, W short requests for code, K a reply's code block to explain, fix,
comment or rename, R a reply's passage and a question about it, S a passage to summarize
(``--sharegpt A:2048,C:1024`` adds random ShareGPT prompts of ``prompts``' groups), for
``distill --groups T,Q,M,W,K,R,S``. On an H200 (batch 1024, 256 answer tokens) the target answered
14,652 of them (3.7 M tokens) in 3.5 min (benchmarks/results/h200-2026-11-27-eagle-tasks/).

Text files: a list of (token ids uint16 [T], answer start) pairs (``torch.save``), or parts
packed by ``--copy-to``; prompt files a dict of named lists of prompt ids. ``--target``
defaults to the embedded default target.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculant.errors import SpeculantError
from speculant.models.loading import load_model
from speculant.tools import texts
from speculant.tools.train_batched import BatchedSettings, run_batched


def distill(a) -> None:
    target = load_model(a.target, device=a.device, dtype=a.dtype)
    out = texts.distill(target, torch.load(a.prompts), a.groups.split(","), a.out, sampled=tuple(a.sampled.split(",")),
                        temperature=a.temperature, batch=a.batch, answer_tokens=a.answer_tokens, copy_to=a.copy_to,
                        minutes=a.minutes, seed=a.seed)
    print(f"distilled {len(out)} sequences, {sum(len(x) for x, _ in out)} tokens")


def prompts(a) -> None:
    groups = texts.sharegpt_prompts(load_model(a.target, device=a.device, dtype="float32").tokenizer, a.skip)
    torch.save(groups, a.out)
    print({k: len(v) for k, v in groups.items()})


def tasks(a) -> None:
    tok = load_model(a.target, device=a.device, dtype="float32").tokenizer
    groups = texts.task_prompts(tok, a.skip, _sizes(a.sizes) if a.sizes else None, a.max_tokens, a.seed)
    if a.sharegpt:  # random ShareGPT prompts beside them (sharegpt_prompts' groups), not only tasks
        more, rng = texts.sharegpt_prompts(tok, a.sharegpt_skip), random.Random(a.seed)
        for name, n in _sizes(a.sharegpt).items():
            fit = [x for x in more[name] if len(x) <= a.max_tokens]
            groups[name] = rng.sample(fit, min(n, len(fit)))
    torch.save(groups, a.out)
    print({k: len(v) for k, v in groups.items()})


def _sizes(text: str) -> dict[str, int]:
    """"T:2048,Q:1024" -> {"T": 2048, "Q": 1024}"""
    return {k: int(v) for k, v in (x.split(":") for x in text.split(","))}


def self_instruct(a) -> None:
    target = load_model(a.target, device=a.device, dtype=a.dtype)
    found = texts.self_instruct(target, a.count, a.batch, a.query_tokens, a.temperature, a.top_p, a.min_chars,
                                a.minutes, a.seed)
    torch.save({"M": found}, a.out)
    print(f"{len(found)} prompts the target wrote")


def from_cache(a) -> None:
    found = texts.texts_from_cache(a.cache)
    texts.save_texts(found, a.out)
    print(f"{len(found)} texts, {sum(len(x) for x, _ in found)} tokens")


def train(a) -> None:
    settings = BatchedSettings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(BatchedSettings)})
    on_step = fit_minutes(a.minutes) if a.minutes and not a.steps else None
    run_batched(settings, on_step=on_step, write=write_apart)


def fit_minutes(minutes: float, log=print):
    """``run_batched``'s on_step for ``--minutes``: steps 15 to 45 timed (the first ones pay for new
    shapes), then the schedule cut to the steps that fit the time left."""
    marks = {}

    def on_step(run) -> None:
        if run.step == 15:
            marks["t15"] = time.time()
        if run.step == 45:
            per_step = (time.time() - marks["t15"]) / 30
            fits = run.step + int((minutes * 60 - (time.time() - run.started)) / per_step)
            if fits < run.total:
                log(f"{per_step * 1000:.0f} ms/step: {run.total} steps do not fit {minutes} min; {fits}", flush=True)
                run.total = fits

    return on_step


def write_apart(out: Path, state: dict) -> None:
    """``run_batched``'s weights with the LM head apart from the rest: the GPU machine returns files
    of 16 MiB at most."""
    head = {k: state.pop(k).contiguous() for k in ["lm_head.weight"] if k in state}
    save_file(head, str(out / "lm_head.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "rest.safetensors"))


def join(out) -> int:
    """``write_apart``'s files as one ``model.safetensors`` again, a drafter folder ``--drafter
    trained:DIR`` loads. Returns the number of tensors."""
    out = Path(out)
    state = load_file(str(out / "rest.safetensors")) | load_file(str(out / "lm_head.safetensors"))
    save_file({k: state[k].contiguous() for k in sorted(state)}, str(out / "model.safetensors"))
    for part in ("rest", "lm_head"):
        (out / f"{part}.safetensors").unlink()
    return len(state)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("join").add_argument("--out", required=True, help="the folder ``train`` wrote")
    for name in ("prompts", "tasks", "self-instruct", "from-cache", "distill", "train"):
        q = sub.add_parser(name)
        q.add_argument("--target", default="default")
        q.add_argument("--device", default="cuda")
        q.add_argument("--out", required=True)
        q.add_argument("--minutes", type=float, help="self-instruct/distill/train: stop within about this time")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--dtype", default="bfloat16", help="the target's (self-instruct, distill, train)")
    sub.choices["prompts"].add_argument("--skip", type=int, default=0)
    k = sub.choices["tasks"]
    k.add_argument("--skip", type=int, default=0, help="ShareGPT conversations to pass over")
    k.add_argument("--sizes", help="group:count,... (default: texts.TASK_SIZES)")
    k.add_argument("--max-tokens", type=int, default=512, help="longest prompt (chat-templated)")
    k.add_argument("--sharegpt", help="also random prompts of `prompts`' groups, e.g. A:2048,C:1024")
    k.add_argument("--sharegpt-skip", type=int, default=7168, help="`prompts`' --skip for those")
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
    t.add_argument("--work", help="a folder for checkpoints (one each evaluation; none without it)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    a = p.parse_args()
    stages = {"prompts": prompts, "tasks": tasks, "self-instruct": self_instruct, "from-cache": from_cache, "distill": distill,
              "train": train, "join": lambda a: print(f"{a.out}/model.safetensors: {join(a.out)} tensors")}
    try:
        stages[a.cmd](a)
    except SpeculantError as e:  # bad input: one line, exit 2, as the CLI does
        print(f"gpu_eagle.py {a.cmd}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
