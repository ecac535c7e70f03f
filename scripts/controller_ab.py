"""γ auto's controller of this tree beside a git revision's, in one process: tok/s per bench
category against plain decoding, calls interleaved (order reversed every other repeat).

    python scripts/controller_ab.py --base HEAD --drafters eagle,eagle+ngram [--dtype q8] \
        [--per-category 3] [--repeats 2] [--tokens 64] [--out ab.json]

Each drafter runs twice under ``--gamma auto``, once with ``--base``'s speculant/controller.py (loaded
under a name of its own; the engine's γ controls and cost model swapped in for its calls) and once
with this tree's. Made benchmarks/results/cpu-AVX512BF16-2026-11-29-zen4-gamma-auto/."""
import argparse
import collections
import subprocess
import sys
import time

import speculant
from ab_common import REPO, dump_side_by_side
from speculant import controller, engine
from speculant.bench.prompts import read_prompts

CONTROLS = ("ChainGamma", "CostModel", "FixedGamma", "HybridGamma", "TreeGamma")


def controller_at(rev: str):
    """``rev``'s speculant/controller.py as a module of its own (its relative imports: this tree's)."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:speculant/controller.py"], capture_output=True,
                         text=True, check=True).stdout
    name = "speculant.controller_base"
    module = type(sys)(name)
    module.__package__ = "speculant"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:speculant/controller.py", "exec"), module.__dict__)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a git revision whose controller runs beside this tree's")
    p.add_argument("--drafters", default="eagle,eagle+ngram")
    p.add_argument("--dtype", default="q8")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    base = controller_at(a.base)
    by_category = collections.defaultdict(list)
    for prompt in read_prompts():
        by_category[prompt.category].append(prompt.prompt)
    methods = {"none": (speculant.load("default", drafter="none", dtype=a.dtype), controller)}
    for drafter in a.drafters.split(","):
        for side, module in ((f"base {a.base}", base), ("this tree", controller)):
            gen = speculant.load("default", drafter=drafter, dtype=a.dtype, gamma="auto")
            gen.engine.costs = module.CostModel()
            methods[f"{drafter}@auto, {side}"] = (gen, module)

    def run(gen, module, prompt, tokens):
        for name in CONTROLS:
            setattr(engine, name, getattr(module, name))
        return gen.generate(prompt, max_new_tokens=tokens, temperature=0.0).stats

    for gen, module in methods.values():  # warm: kernels, caches, the engine's first costs
        run(gen, module, by_category["rag"][0], 16)
    res = collections.defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "passes": 0})
    for rep in range(a.repeats):
        for category, prompts in by_category.items():
            for prompt in prompts[: a.per_category]:
                order = list(methods.items())
                for m, (gen, module) in order if rep % 2 == 0 else order[::-1]:
                    t = time.perf_counter()
                    s = run(gen, module, prompt, a.tokens)
                    r = res[(m, category)]
                    r["seconds"] += time.perf_counter() - t
                    r["tokens"] += s["new_tokens"]
                    r["passes"] += s["target_forward_passes"]
    run(*methods["none"], by_category["rag"][0], 1)  # the engine's own controls back

    def rate(m, cats):
        return sum(res[(m, c)]["tokens"] for c in cats) / sum(res[(m, c)]["seconds"] for c in cats)

    categories, summary = list(by_category), {}
    print("method".ljust(30) + "".join(c[:9].rjust(10) for c in categories) + "       all   tok/s    tau")
    for m in methods:
        per = {c: rate(m, [c]) / rate("none", [c]) for c in categories}
        tau = sum(res[(m, c)]["tokens"] for c in categories) / sum(res[(m, c)]["passes"] for c in categories)
        summary[m] = {"vs_plain_by_category": per, "vs_plain": rate(m, categories) / rate("none", categories),
                      "tokens_per_second": rate(m, categories), "tau": tau}
        print(m.ljust(30) + "".join(f"{per[c]:10.3f}" for c in categories) +
              f"{summary[m]['vs_plain']:10.3f}{rate(m, categories):8.1f}{tau:7.2f}")
    if a.out:
        dump_side_by_side(a.out, a, summary, res)


if __name__ == "__main__":
    main()
