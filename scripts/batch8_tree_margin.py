"""Batch 8 side by side: none vs eagle+ngram at TREE_MARGIN 0.9 and 1.0 (24 prompts, 3 batches of 8).

    OUT_JSON=batch8-tree-margin-bf16.json python scripts/batch8_tree_margin.py bfloat16 0.9,1.0

Made benchmarks/results/cpu-AVX512BF16-2026-11-25-stacked-matmuls/batch8-tree-margin-bf16.json."""
import sys, time
import speculant
from ab_common import prompts_by_category, save_results
from speculant.controller import TreeGamma
dtype = sys.argv[1]; margins = [float(x) for x in sys.argv[2].split(",")]; bs = int(sys.argv[3]) if len(sys.argv) > 3 else 8
prompts = prompts_by_category(3)
none = speculant.load("default", drafter="none", dtype=dtype)
spec = speculant.load("default", drafter="eagle+ngram", dtype=dtype)
methods = [("none", none, None)] + [(f"eagle+ngram m{m}", spec, m) for m in margins]
for _, g, _ in methods: g.generate(prompts[:bs], max_new_tokens=8)
acc = {n: [0, 0.0, 0] for n, _, _ in methods}
for rep in range(2):
    for i in range(0, len(prompts), bs):
        batch = prompts[i:i + bs]
        order = methods[(i // bs + rep) % len(methods):] + methods[:(i // bs + rep) % len(methods)]
        for name, g, m in order:
            if m is not None: TreeGamma.TREE_MARGIN = m
            t = time.perf_counter(); outs = g.generate(batch, max_new_tokens=64); el = time.perf_counter() - t
            a = acc[name]; a[0] += sum(o.stats["new_tokens"] for o in outs); a[1] += el; a[2] += sum(o.stats["target_forward_passes"] for o in outs)
for name, (n, sec, passes) in acc.items():
    print(f"batch {bs} {dtype} {name:18s} {n/sec:6.1f} tok/s  τ {n/passes:.2f}")

save_results(acc)
