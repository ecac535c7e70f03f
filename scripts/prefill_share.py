"""How much of a bench request's time comes before its first new token, plain decoding in
``--dtype``: each prompt asked for ``--tokens``, the engine's own account of the request
(``first_token_seconds`` of ``seconds``); per category the share of the request's time and the
speedup its decoding would need for a given overall one (``--target``): 1 / (share + (1 - share) / s)
= target. The bench compares methods prefill included, and the prefill is the same for every method.

    python scripts/prefill_share.py [--dtype q8] [--per-category 22] [--tokens 64] [--target 1.3] [--out F.json]
"""
import argparse
import collections
import json

import torch

import speculant
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts


def needed(share: float, target: float) -> float | None:
    """The decoding speedup s with 1 / (share + (1 - share) / s) = target; None where no s reaches it."""
    return (1 - share) / (1 / target - share) if 1 / target > share else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="q8")
    p.add_argument("--per-category", type=int, default=22)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--target", type=float, default=1.3)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    gen = speculant.load("default", drafter="none", dtype=a.dtype)
    by_category = collections.defaultdict(list)
    for prompt in read_prompts():
        by_category[prompt.category].append(prompt.prompt)
    gen.generate(by_category["rag"][0], max_new_tokens=16, temperature=0.0)  # warm-up
    sums = collections.defaultdict(lambda: {"prompts": 0, "first_token_s": 0.0, "request_s": 0.0, "new_tokens": 0})
    for category, prompts in by_category.items():
        for prompt in prompts[: a.per_category]:
            stats, s = gen.generate(prompt, max_new_tokens=a.tokens, temperature=0.0).stats, sums[category]
            s["first_token_s"] += stats["first_token_seconds"]
            s["request_s"] += stats["seconds"]
            s["new_tokens"] += stats["new_tokens"]
            s["prompts"] += 1
    everything = {k: sum(s[k] for s in sums.values()) for k in ("prompts", "first_token_s", "request_s", "new_tokens")}
    results = {}
    for name, s in [*sums.items(), ("all", everything)]:
        share = s["first_token_s"] / s["request_s"]
        results[name] = {**s, "share": round(share, 4), "decoding_speedup_needed": needed(share, a.target)}
        need = results[name]["decoding_speedup_needed"]
        print(f"{name:20s} {s['prompts']:3d} prompts  first token {s['first_token_s'] / s['prompts'] * 1e3:6.0f} ms  "
              f"request {s['request_s'] / s['prompts'] * 1e3:6.0f} ms  share {share:.2f}  decoding "
              + (f"x{need:.2f}" if need else "(no speedup)") + f" for x{a.target} overall", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
