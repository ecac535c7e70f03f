"""``speculant generate`` in fresh processes, as a user runs it once: with no costs kept from an
earlier run (``fresh``: γ auto times a plain pass and wide blocks, and judges its first drafts by its
prior) against with the costs the run before kept (``kept``, tools/kept_costs.py), alternated run by
run; the stats of each (tok/s, passes, mean γ). A run's kept costs are set aside while a ``fresh``
one runs and put back after it.

    python scripts/kept_costs_ab.py [--prompt TEXT] [--max-new-tokens N] [--rounds 6] [--out F.json]

Made benchmarks/results/cpu-AMX-2026-11-30-xeon-kept-costs/."""
import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from speculant.bench.machine import machine_info
from speculant.models.loading import cache_dir


def generate(prompt: str, extra: list[str]) -> dict:
    out = subprocess.run(["speculant", "generate", prompt, "--json", *extra], capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)["stats"]
    return {"tok_s": round(stats["tokens_per_second"], 1), "passes": stats["target_forward_passes"],
            "mean_gamma": round(stats["mean_gamma"], 2), "tokens": stats["new_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Write a haiku about rivers")  # the README's first command
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out")
    a = ap.parse_args()
    extra = [] if a.max_new_tokens is None else ["--max-new-tokens", str(a.max_new_tokens)]
    kept, aside = cache_dir() / "costs", Path(tempfile.mkdtemp(prefix="kept-costs-")) / "costs"
    generate(a.prompt, extra)  # a run to keep costs from (and to build or load whatever the first run does)
    runs = {"fresh": [], "kept": []}
    for _ in range(a.rounds):
        shutil.move(str(kept), str(aside))
        runs["fresh"].append(generate(a.prompt, extra))
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(str(aside), str(kept))
        runs["kept"].append(generate(a.prompt, extra))
        print(f"fresh {runs['fresh'][-1]}  kept {runs['kept'][-1]}", flush=True)
    summary = {name: {"median_tok_s": statistics.median(r["tok_s"] for r in rs),
                      "median_mean_gamma": statistics.median(r["mean_gamma"] for r in rs)} for name, rs in runs.items()}
    summary["kept_faster_in"] = sum(k["tok_s"] > f["tok_s"] for f, k in zip(runs["fresh"], runs["kept"]))
    print(summary)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
