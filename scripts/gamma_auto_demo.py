"""Small demo of ``--gamma auto`` against fixed γ and plain decoding (the full bench is elsewhere).

For the first prompt of a few bench categories, greedy-decode with the n-gram drafter at each
γ setting and print tokens/s, τ and the mean γ used. One run each: on a shared CPU the timings
are noisy. Usage: PYTHONPATH=. python scripts/gamma_auto_demo.py [--categories code rag ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import speculant
from speculant.bench.machine import machine_info, what_ran
from speculant.drafters import make_drafter

PROMPTS = Path(__file__).resolve().parents[1] / "speculant" / "bench" / "prompts" / "default.jsonl"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", nargs="+", default=["code", "rag", "multi_turn_chat"])
    ap.add_argument("--gammas", nargs="+", default=["none", "2", "4", "6", "auto"])
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    target = speculant.load("default", drafter="none").target
    results = []
    for cat in args.categories:
        prompt = next(r["prompt"] for r in rows if r["category"] == cat)
        for g in args.gammas:
            drafter = make_drafter("none" if g == "none" else args.drafter, target)
            gen = speculant.Generator(target, drafter, gamma=None if g == "none" else (g if g == "auto" else int(g)))
            gen.generate(prompt, max_new_tokens=4)  # warm-up
            out = gen.generate(prompt, max_new_tokens=args.max_new_tokens)
            s = out.stats
            results.append(dict(category=cat, gamma=g, ran=what_ran(gen), tokens_per_second=s["tokens_per_second"],
                                tau=s["mean_accepted_tokens"], alpha=s["acceptance_rate"], mean_gamma=s["mean_gamma"],
                                new_tokens=s["new_tokens"]))
            print(f"{cat:18s} γ={g:5s} {s['tokens_per_second']:7.2f} tok/s  τ={s['mean_accepted_tokens']:.2f}  "
                  f"α={s['acceptance_rate']:.2f}  mean γ={s['mean_gamma']:.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
