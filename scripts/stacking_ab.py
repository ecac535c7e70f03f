"""Side by side in one process: separate vs stacked projections (target bf16 packs and the EAGLE head).

    OUT_JSON=stacking-ab-bf16.json python scripts/stacking_ab.py bfloat16 none,eagle+ngram

Made benchmarks/results/cpu-AVX512BF16-2026-11-25-stacked-matmuls/stacking-ab-*.json."""
import sys
import speculant
from ab_common import prompts_by_category, save_results
from speculant.models import cpu_kernels
dtype = sys.argv[1]; drafters = sys.argv[2].split(",")
prompts = prompts_by_category(2)
gens = {}
real_exact, real_stacked = cpu_kernels.stacking_is_exact, dict(cpu_kernels.STACKED)
for variant in ("separate", "stacked"):
    if variant == "separate":
        cpu_kernels.stacking_is_exact = lambda *a: False; cpu_kernels.STACKED.clear()
    else:
        cpu_kernels.stacking_is_exact = real_exact; cpu_kernels.STACKED.update(real_stacked)
    for d in drafters:
        gens[(variant, d)] = speculant.load("default", drafter=d, dtype=dtype)
for g in gens.values(): g.generate(prompts[0], max_new_tokens=16)
acc = {k: [0, 0.0, 0, 0.0] for k in gens}
for i, p in enumerate(prompts):
    keys = list(gens)
    keys = keys[i % len(keys):] + keys[: i % len(keys)]
    outs = {}
    for k in keys:
        o = gens[k].generate(p, max_new_tokens=64); s = o.stats
        a = acc[k]; a[0] += s["new_tokens"]; a[1] += s["seconds"]; a[2] += s["target_forward_passes"]; a[3] += s["drafter_seconds"]
        outs[k] = o.token_ids
    for d in drafters:
        if outs[("separate", d)] != outs[("stacked", d)]: print("DIFFERENT OUTPUT", d, i)
for k, (n, sec, passes, dsec) in acc.items():
    print(f"{k[0]:9s} {k[1]:12s} {n/sec:6.1f} tok/s  τ {n/passes:.2f}  drafting {dsec/passes*1e3:.2f} ms/pass")

save_results(acc)
