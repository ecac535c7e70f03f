"""What the side-by-side scripts share: the bench prompts grouped by category, and their results
written where ``OUT_JSON`` says (with the machine that measured them)."""
import json
import os
import sys

from speculant.bench.costs import bench_prompts
from speculant.bench.machine import machine_info


def prompts_by_category(per_category: int) -> list[str]:
    """The first ``per_category`` bench prompts of each category, a category's prompts together."""
    taken = bench_prompts(per_category)
    order = list(dict.fromkeys(cat for cat, _ in taken))
    return [p for _, p in sorted(taken, key=lambda item: order.index(item[0]))]


def save_results(results: dict, **extra) -> None:
    """``results`` (keys may be tuples) to $OUT_JSON, if set."""
    out = os.environ.get("OUT_JSON")
    if out:
        named = {" | ".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in results.items()}
        with open(out, "w") as f:
            json.dump({"argv": sys.argv, "machine": machine_info(), **extra, "results": named}, f, indent=1)
