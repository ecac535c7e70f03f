"""The engine's Python beside a git revision's, in one process: this tree's speculant and ``--base``'s
(its speculant/ taken with ``git archive``, imported as ``speculant_base``), each loading the default
target in ``--dtype`` with each drafter of ``--methods``; the bench prompts' requests alternated
(the order reversed every other one). Reports tok/s per category, whether both sides wrote the
same texts, and the milliseconds a generated token spends outside the kernels' calls (the target's
pass, the EAGLE head's chain): the part a change of the engine's bookkeeping moves, measured where
a whole request's time swings with the VM by more than that change.

    python scripts/engine_ab.py --base REV [--methods "none;ngram;eagle+ngram"] [--per-category 3]
        [--categories multi_turn_chat,code,question_answering,summarization] [--repeats 2] [--out F.json]

Made benchmarks/results/cpu-AVX512BF16-2026-11-29-zen4-lighter-bookkeeping/."""
import argparse
import collections
import importlib.util
import json
import sys
import time

import torch

import speculant
from ab_common import revision_files
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts
from speculant.models import quantized

TIMED = ("run_pass", "eagle_chain")  # the kernels' calls whose time is not the engine's


def speculant_at(rev: str):
    """``rev``'s speculant package, imported as ``speculant_base`` (every import inside it is relative)."""
    folder, _ = revision_files(rev, "speculant")
    spec = importlib.util.spec_from_file_location("speculant_base", folder / "speculant/__init__.py",
                                                  submodule_search_locations=[str(folder / "speculant")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["speculant_base"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--methods", default="none;ngram;eagle+ngram")
    p.add_argument("--dtype", default="q8")
    p.add_argument("--categories", default="multi_turn_chat,code,question_answering,summarization")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    sides = {"base": speculant_at(a.base), "this tree": speculant}
    methods, cats = a.methods.split(";"), a.categories.split(",")
    by_cat = collections.defaultdict(list)
    for bp in read_prompts():
        by_cat[bp.category].append(bp.prompt)
    prompts = [(c, x) for c in cats for x in by_cat[c][: a.per_category]]
    gens = {}
    for m in methods:
        drafter, _, gamma = m.partition("@")
        for side, module in sides.items():
            gens[m, side] = module.load("default", drafter=drafter, dtype=a.dtype,
                                        gamma=int(gamma) if gamma and gamma != "auto" else None)
    ids = {m: [gens[m, "this tree"].encode(x) for _, x in prompts] for m in methods}
    for (m, _), gen in gens.items():
        gen.generate_ids([ids[m][0]], max_new_tokens=16)  # warm: kernels built, costs first timed

    now = [None]  # the (method, side) whose request runs
    kernel_seconds, kernel_calls = collections.defaultdict(float), collections.Counter()
    modules = {id(m): m for m in (quantized.kernels(), sys.modules["speculant_base.models.quantized"].kernels())}
    for module in modules.values():
        for name in TIMED:
            if hasattr(module, name):
                def timed(*args, _fn=getattr(module, name), **kw):
                    t = time.perf_counter()
                    try:
                        return _fn(*args, **kw)
                    finally:
                        kernel_seconds[now[0]] += time.perf_counter() - t
                        kernel_calls[now[0]] += 1
                setattr(module, name, timed)

    seconds, tokens, texts = collections.defaultdict(float), collections.Counter(), {}
    for r in range(a.repeats):
        for i, (cat, _) in enumerate(prompts):
            for m in methods:
                for side in (list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]):
                    now[0] = (m, side)
                    t = time.perf_counter()
                    out = gens[m, side].generate_ids([ids[m][i]], max_new_tokens=a.tokens)[0]
                    seconds[m, side, cat] += time.perf_counter() - t
                    tokens[m, side, cat] += len(out.token_ids)
                    texts.setdefault((m, i), {})[side] = list(out.token_ids)
    same = all(len({tuple(v) for v in pair.values()}) == 1 for pair in texts.values())
    summary = {}
    for m in methods:
        row = {}
        for side in sides:
            total, made = sum(seconds[m, side, c] for c in cats), sum(tokens[m, side, c] for c in cats)
            row[side] = {"seconds": round(total, 4), "tokens": made, "kernel_calls": kernel_calls[m, side],
                         "outside_kernels_ms_per_token": round((total - kernel_seconds[m, side]) / made * 1e3, 4),
                         "tokens_per_second_by_category": {c: round(tokens[m, side, c] / seconds[m, side, c], 2)
                                                           for c in cats}}
        row["speed_this_tree_over_base"] = round(row["base"]["seconds"] / row["this tree"]["seconds"], 4)
        summary[m] = row
        print(f"{m:14s} this tree / base {row['speed_this_tree_over_base']:.3f}x  outside the kernels "
              f"{row['base']['outside_kernels_ms_per_token']:.3f} -> {row['this tree']['outside_kernels_ms_per_token']:.3f}"
              f" ms a token  (kernel calls {kernel_calls[m, 'base']} / {kernel_calls[m, 'this tree']})", flush=True)
    print("same texts on both sides:", same, "| kernels modules shared:", len(modules) == 1)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "same_texts": same,
                       "kernels_shared": len(modules) == 1, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
