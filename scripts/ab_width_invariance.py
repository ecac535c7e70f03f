"""The default drafter and plain decoding before and after the width-invariant kernels, side by side
in one process: the previous commit's package imported under another name (``--before DIR``: a folder
holding it as ``speculant_base``), each prompt run by both, the order alternating, several rounds.

    git worktree add /tmp/base 112adcf && mkdir /tmp/basepkg && cp -r /tmp/base/speculant /tmp/basepkg/speculant_base
    python scripts/ab_width_invariance.py --before /tmp/basepkg --out ab.json
"""
import argparse
import importlib
import json
import sys
import time

import torch

import speculant
from speculant.bench.machine import machine_info, what_ran
from speculant.bench.prompts import read_prompts, select_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="ab.json")
    a = ap.parse_args()
    sys.path.insert(0, a.before)
    base = importlib.import_module("speculant_base")
    prompts = [p.prompt for p in select_prompts(read_prompts(), per_category=2)]
    gens = {}
    for version, pkg in (("before", base), ("after", speculant)):
        for drafter in ("none", "default"):
            gens[(version, drafter)] = pkg.load("default", drafter=None if drafter == "default" else drafter,
                                                dtype=a.dtype)
    ids = [gens[("after", "none")].encode(p) for p in prompts]
    for g in gens.values():  # warm-up: caches, kernels, the controller's costs
        g.generate_ids([ids[0]], max_new_tokens=16)
    totals = {k: [0, 0.0, 0] for k in gens}  # tokens, seconds, target passes
    texts = {k: [None] * len(ids) for k in gens}
    order = list(gens)
    for r in range(a.rounds):
        for i, x in enumerate(ids):
            for k in (order if (r + i) % 2 == 0 else order[::-1]):
                t = time.perf_counter()
                o = gens[k].generate_ids([x], max_new_tokens=a.max_new_tokens)[0]
                totals[k][1] += time.perf_counter() - t
                totals[k][0] += len(o.token_ids)
                totals[k][2] += o.stats["target_forward_passes"]
                texts[k][i] = o.token_ids
        print(f"round {r + 1}: " + ", ".join(f"{v} {d} {t[0] / t[1]:.1f} tok/s" for (v, d), t in totals.items()),
              flush=True)
    res = {"machine": machine_info(), "ran": {f"after {d}": what_ran(gens[("after", d)]) for d in ("none", "default")},
           "dtype": a.dtype, "torch": torch.__version__, "rounds": a.rounds, "prompts": len(ids),
           "max_new_tokens": a.max_new_tokens, "results": {}}
    for (v, d), (tok, sec, passes) in totals.items():
        res["results"][f"{v} {d}"] = {"tokens_per_second": round(tok / sec, 2), "tau": round(tok / passes, 3),
                                      "exact": gens[(v, d)].backend.info().get("exact", "n/a (before)")}
    for v in ("before", "after"):
        same = sum(p == q for p, q in zip(texts[(v, "default")], texts[(v, "none")]))
        res["results"][f"{v} default"]["equal to its plain decoding"] = f"{same}/{len(ids)}"
    for d in ("none", "default"):
        b, af = res["results"][f"before {d}"]["tokens_per_second"], res["results"][f"after {d}"]["tokens_per_second"]
        res["results"][f"after {d}"]["vs before"] = round(af / b, 3)
    print(json.dumps(res["results"], indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
