"""Seeded (SEED=1) or unseeded requests at a temperature, one drafter at several γ: tokens/s and τ
over 8 chat, code and math bench prompts, 64 new tokens.

    SEED=1 OUT_JSON=t1-seeded-default.json python scripts/temperature1_seeded.py bfloat16 eagle+ngram auto,8,auto,8

Made benchmarks/results/cpu-AVX512BF16-2026-11-25-bench-answers/t1-seeded-*.json."""
import sys, time, json
import torch, speculant
from speculant.bench.machine import machine_info, what_ran
import os
SEED = os.environ.get("SEED") == "1"
dtype = sys.argv[1]; drafter = sys.argv[2]; gammas = sys.argv[3].split(","); temp = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
from pathlib import Path
rows = [json.loads(l) for l in open(Path(speculant.__file__).parent / "bench" / "prompts" / "default.jsonl")]
res = {}
prompts = [r["prompt"] for r in rows if r["category"] in ("multi_turn_chat", "code", "math_reasoning")][::5][:8]
gen = speculant.load("default", drafter=drafter, dtype=dtype)
gen.generate(prompts[0], max_new_tokens=16, temperature=temp, seed=0)
for g in gammas:
    gamma = g if g == "auto" else int(g)
    tot = passes = 0; t = time.perf_counter()
    for i, p in enumerate(prompts):
        o = gen.generate(p, max_new_tokens=64, temperature=temp, gamma=gamma, seed=i if SEED else None)
        tot += o.stats["new_tokens"]; passes += o.stats["target_forward_passes"]
    el = time.perf_counter() - t
    print(f"{drafter} T={temp} γ {g}: {tot/el:.1f} tok/s τ {tot/passes:.2f}", flush=True)
    res.setdefault(f"{drafter} gamma {g}", []).append({"tokens_per_second": round(tot / el, 1), "tau": round(tot / passes, 3)})
if os.environ.get("OUT_JSON"):
    json.dump({"argv": sys.argv, "machine": machine_info(), "ran": what_ran(gen), "seeded": SEED, "temperature": temp, "prompts": "8 of chat/code/math, 64 new tokens",
               "results": res}, open(os.environ["OUT_JSON"], "w"), indent=1)
