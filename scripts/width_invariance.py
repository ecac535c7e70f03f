"""Speculative text against plain decoding, and plain decoding against HF ``generate``, on the bench
prompts with the embedded default model: every drafter, γ auto and 4, each request twice (is it
repeatable?), batch 1 and a batch of 4. Prints a table and writes JSON (uses the public package only).

    python scripts/width_invariance.py --dtype bfloat16 --out results.json
"""
import argparse
import json
import time

import torch

import speculant
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts, select_prompts

DRAFTERS = ["ngram", "ngram:tree", "suffix", "eagle", "eagle+ngram", "layerskip"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--out", default="width-invariance.json")
    a = ap.parse_args()
    prompts = select_prompts(read_prompts(), per_category=a.per_category)
    plain_gen = speculant.load("default", drafter="none", dtype=a.dtype)
    texts = [p.prompt for p in prompts]
    ids = [plain_gen.encode(t) for t in texts]
    model = plain_gen.target.model
    t0 = time.time()
    plain = [o.token_ids for o in (plain_gen.generate_ids([x], max_new_tokens=a.max_new_tokens)[0] for x in ids)]
    res = {"machine": machine_info(), "dtype": a.dtype, "torch": torch.__version__, "prompts": len(ids),
           "backend": plain_gen.backend.info(), "cases": {}}
    # plain decoding against HF generate (the model's own computation in this dtype), with the gap where they part
    agree, gaps = 0, []
    for x, mine in zip(ids, plain):
        inp = torch.tensor([x])
        with torch.no_grad():
            ref = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=a.max_new_tokens,
                                 do_sample=False)[0, len(x):].tolist()
        k = next((i for i, (r, m) in enumerate(zip(ref, mine)) if r != m), None)
        if k is None:
            agree += 1
            continue
        with torch.no_grad():
            logits = model(torch.tensor([x + ref[:k]])).logits[0, -1].float()
        gaps.append(round(float(logits[ref[k]] - logits[mine[k]]), 4))
    res["plain equals HF generate"] = f"{agree}/{len(ids)}"
    res["HF divergence logit gaps"] = gaps
    print(f"plain decoding = HF generate ({a.dtype}): {agree}/{len(ids)}; gaps where they part: {gaps}")
    for name in a.drafters.split(","):
        gen = speculant.load("default", drafter=name, dtype=a.dtype)
        for gamma in ("auto", 4):
            same = runs = accepted = 0
            for rep in range(2):
                for x, ref in zip(ids, plain):
                    o = gen.generate_ids([x], max_new_tokens=a.max_new_tokens, gamma=gamma)[0]
                    same += o.token_ids == ref
                    runs += 1
                    accepted += o.stats["accepted_draft_tokens"]
            for i in range(0, len(ids), 4):  # batches of 4
                outs = gen.generate_ids(ids[i : i + 4], max_new_tokens=a.max_new_tokens, gamma=gamma)
                same += sum(o.token_ids == ref for o, ref in zip(outs, plain[i : i + 4]))
                runs += len(outs)
            key = f"{name} gamma={gamma}"
            res["cases"][key] = {"equal plain": same, "runs": runs, "accepted draft tokens": accepted,
                                 "exact": o.stats.get("exact")}
            print(f"{key:24s} {same}/{runs} equal plain decoding (accepted {accepted} drafts; stats say "
                  f"{o.stats.get('exact')})", flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    res["all equal"] = all(c["equal plain"] == c["runs"] for c in res["cases"].values())
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"all speculative outputs equal plain decoding: {res['all equal']}; written {a.out}")


if __name__ == "__main__":
    main()
