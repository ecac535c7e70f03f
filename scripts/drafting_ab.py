"""Drafters side by side in one process, calls interleaved (order reversed every other repeat): tok/s
per bench category against the first method (with a 90 % bootstrap interval over the prompts), τ, and
drafting / the rest of a pass in ms.

    python scripts/drafting_ab.py --dtype q8 --methods "none;eagle@2;eagle@2:tree;ngram@auto" \
        [--per-category 1] [--repeats 2] [--tokens 64] [--out ab.json]

A method is DRAFTER[@GAMMA][:tree][:head-bitsN][:float32-head][:trees-only][:charged-lookup][:base|:base-controller];
``:head-bitsN`` rounds a drafter's network on the int8 kernels to N bits a weight (``quantized.DRAFT_BITS``,
4 or 8) instead of the default (4 since 2026-12-06); ``:tree`` drafts an EAGLE
head's tree in PyTorch calls where it would otherwise draft its chain in one kernel call (beside a
target on the CPU kernels); ``:float32-head`` builds the drafter as ``SPECULANT_CPU_KERNELS=onednn``
would (beside a float32 target: its network in float32, not on the int8 kernels), the target as the
others; ``:trees-only`` keeps ``X+ngram``'s γ auto from drafting the lookup alone while the
trees are off (the control before controller.HybridGamma); ``:charged-lookup`` has γ auto charge seen lookup
chains the engine's drafting cost, as it did before 2026-11-28 (``X+ngram``'s lookup the head's
~2 ms a proposal); ``:base`` runs on the CPU kernels built
from ``--base REV``'s csrc/ (a git revision: a kernel change against the build before it, in one
process: ``--base HEAD~1 --methods "none:base;none;eagle@2:base;eagle@2"``); ``:base-controller`` runs
γ auto with ``--base``'s speculant/controller.py (loaded under a name of its own, the engine's γ
controls and cost model swapped in for the method's calls) on this tree's kernels: ``--base REV
--methods "none;eagle+ngram@auto:base-controller;eagle+ngram@auto"``.
Made benchmarks/results/cpu-AVX512BF16-2026-11-27-eagle-chain/, .../cpu-AVX512BF16-2026-11-27-lighter-passes/,
.../cpu-AVX512BF16-2026-11-27-one-region/, .../cpu-AVX2-2026-11-28-zen3-float32-drafts/,
.../cpu-AVX512BF16-2026-11-29-zen4-gamma-auto/, .../cpu-AVX512BF16-2026-11-29-zen4-chain-in-kernel/,
.../cpu-AVX512BF16-2026-11-29-zen4-gamma-auto-all-prompts/, .../cpu-AVX512BF16-2026-11-29-zen4-wider-q8-tiles/ and
.../cpu-AVX512BF16-2026-12-06-zen4-head-bits/."""
import argparse
import collections
import os
import random
import re
import time
from unittest import mock

import speculant
from ab_common import Kernels, controller_at, dump_side_by_side
from speculant import controller, engine
from speculant.bench.prompts import read_prompts
from speculant.drafters import make_drafter
from speculant.models import cpu_kernels, quantized


CONTROLS = ("ChainGamma", "CostModel", "FixedGamma", "HybridGamma", "TreeGamma")  # what engine.py takes of controller.py


def eagle_in(drafter):
    """The EAGLE drafter inside ``drafter`` (itself, or the tree half of ``X+ngram``)."""
    return drafter if hasattr(drafter, "chains") else getattr(drafter, "tree", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="q8")
    p.add_argument("--methods", required=True, help='"none;eagle@2;eagle@2:tree;ngram@auto"')
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--base", help="a git revision whose CPU kernels the methods marked :base run on")
    p.add_argument("--out")
    a = p.parse_args()
    names = a.methods.split(";")
    kernels = Kernels(a.base if any(m.endswith(":base") for m in names) else None)
    base_controller = controller_at(a.base) if a.base and any(m.endswith(":base-controller") for m in names) else None
    by_category = collections.defaultdict(list)
    for prompt in read_prompts():
        by_category[prompt.category].append(prompt.prompt)
    methods = {}
    on_base, base_control, charged = {}, {}, {}
    verifying = controller.ChainGamma.verifying

    def use(m):  # a method's kernels, its γ controls, and how its γ auto weighs seen chains
        kernels.use(on_base[m])
        for name in CONTROLS:
            setattr(engine, name, getattr(base_controller if base_control[m] else controller, name))
        controller.ChainGamma.verifying = (lambda ctl, batch: ctl.costs(batch)) if charged[m] else verifying

    for m in names:
        spec, on_base[m] = (m[: -len(":base")], True) if m.endswith(":base") else (m, False)
        spec, base_control[m] = ((spec[: -len(":base-controller")], True) if spec.endswith(":base-controller")
                                 else (spec, False))
        if (on_base[m] or base_control[m]) and not a.base:
            p.error(f"{m}: :base and :base-controller need --base REV")
        spec, charged[m] = (spec[: -len(":charged-lookup")], True) if spec.endswith(":charged-lookup") else (spec, False)
        use(m)  # a method's model binds its layers in the module it will run on
        spec, trees_only = (spec[: -len(":trees-only")], True) if spec.endswith(":trees-only") else (spec, False)
        spec, float32_head = (spec[: -len(":float32-head")], True) if spec.endswith(":float32-head") else (spec, False)
        head_bits = re.search(r":head-bits(\d+)$", spec)
        spec, head_bits = (spec[: head_bits.start()], int(head_bits[1])) if head_bits else (spec, quantized.DRAFT_BITS)
        spec, tree = (spec[:-5], True) if spec.endswith(":tree") else (spec, False)
        drafter, _, gamma = spec.partition("@")
        with mock.patch.object(quantized, "DRAFT_BITS", head_bits):
            gen = speculant.load("default", drafter=drafter, dtype=a.dtype)
        if base_control[m]:
            gen.engine.costs = base_controller.CostModel()
        if float32_head:
            with mock.patch.dict(os.environ, {cpu_kernels.ENV: "onednn"}):
                head = make_drafter(drafter, gen.target)
            gen = speculant.Generator(gen.target, head)
        if tree:
            eagle_in(gen.drafter).chains = False
        if trees_only:
            gen.drafter.has_lookup = False
        methods[m] = (gen, {"gamma": gamma if gamma in ("", "auto") else int(gamma)} if gamma else {})
    for m, (gen, kw) in methods.items():  # warm: kernels, caches, the engine's first costs
        use(m)
        gen.generate(by_category["rag"][0], max_new_tokens=16, temperature=0.0, **kw)
    res = collections.defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "passes": 0, "drafting": 0.0})
    by_prompt = collections.defaultdict(lambda: [0, 0.0])  # (method, category, prompt's index): tokens, seconds
    for rep in range(a.repeats):
        for category, prompts in by_category.items():
            for i, prompt in enumerate(prompts[: a.per_category]):
                order = list(methods.items())
                for m, (gen, kw) in order if rep % 2 == 0 else order[::-1]:
                    use(m)
                    t = time.perf_counter()
                    s = gen.generate(prompt, max_new_tokens=a.tokens, temperature=0.0, **kw).stats
                    seconds = time.perf_counter() - t
                    r = res[(m, category)]
                    r["seconds"] += seconds
                    r["tokens"] += s["new_tokens"]
                    r["passes"] += s["target_forward_passes"]
                    r["drafting"] += s.get("drafter_seconds", 0.0)
                    by_prompt[(m, category, i)][0] += s["new_tokens"]
                    by_prompt[(m, category, i)][1] += seconds
    base, categories = next(iter(methods)), list(by_category)

    def total(m, cats):
        return {k: sum(res[(m, c)][k] for c in cats) for k in ("tokens", "seconds", "passes", "drafting")}

    summary = {}
    pad = max(20, max(map(len, methods)) + 1)
    print("method".ljust(pad) + "".join(c[:9].rjust(10) for c in categories) + "       all   tok/s    tau  draft ms  rest ms")
    for m in methods:
        t, b = total(m, categories), total(base, categories)
        per = {c: (res[(m, c)]["tokens"] / res[(m, c)]["seconds"]) / (res[(base, c)]["tokens"] / res[(base, c)]["seconds"])
               for c in categories}
        summary[m] = {"vs_first_by_category": per, "vs_first": t["tokens"] / t["seconds"] / (b["tokens"] / b["seconds"]),
                      "tokens_per_second": t["tokens"] / t["seconds"], "tau": t["tokens"] / t["passes"],
                      "drafting_ms_per_pass": t["drafting"] / t["passes"] * 1e3,
                      "rest_ms_per_pass": (t["seconds"] - t["drafting"]) / t["passes"] * 1e3}
        s = summary[m]
        print(m.ljust(pad) + "".join(f"{per[c]:10.3f}" for c in categories) +
              f"{s['vs_first']:10.3f}{s['tokens_per_second']:8.1f}{s['tau']:7.2f}{s['drafting_ms_per_pass']:10.2f}"
              f"{s['rest_ms_per_pass']:9.2f}")
        if m != base:
            s["interval_by_category"], s["interval"] = intervals(by_prompt, m, base, categories)
            print("  90 %".ljust(pad) + "".join(f"{lo:5.2f}-{hi:.2f}"[:10].rjust(10)
                                                for lo, hi in (s["interval_by_category"][c] for c in categories)) +
                  f"{s['interval'][0]:5.2f}-{s['interval'][1]:.2f}".rjust(10))
    if a.out:
        dump_side_by_side(a.out, a, summary, res, by_prompt={"|".join(map(str, k)): v for k, v in by_prompt.items()})


def intervals(by_prompt: dict, m: str, base: str, categories: list[str], draws: int = 2000):
    """90 % bootstrap intervals of ``m``'s tok/s over ``base``'s, per category and over all, the
    prompts drawn again with replacement within each category (a prompt's repeats stay together):
    how far the ratio could move with other prompts of the same kinds. One chat request moves by
    ±5-10 % between runs, so four prompts a category cannot tell a 3 % loss from noise."""
    rng = random.Random(0)
    prompts = {c: sorted(i for (mm, cc, i) in by_prompt if mm == m and cc == c) for c in categories}

    def ratio(picked):  # picked: (category, prompt index) pairs
        tm = sm = tb = sb = 0.0
        for c, i in picked:
            tm, sm = tm + by_prompt[(m, c, i)][0], sm + by_prompt[(m, c, i)][1]
            tb, sb = tb + by_prompt[(base, c, i)][0], sb + by_prompt[(base, c, i)][1]
        return (tm / sm) / (tb / sb)

    samples = {c: [] for c in categories}
    overall = []
    for _ in range(draws):
        drawn = {c: [(c, rng.choice(prompts[c])) for _ in prompts[c]] for c in categories}
        for c in categories:
            samples[c].append(ratio(drawn[c]))
        overall.append(ratio([pick for c in categories for pick in drawn[c]]))

    def span(xs):
        xs = sorted(xs)
        return [xs[int(0.05 * len(xs))], xs[int(0.95 * len(xs)) - 1]]

    return {c: span(samples[c]) for c in categories}, span(overall)


if __name__ == "__main__":
    main()
