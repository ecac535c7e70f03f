"""γ auto with prompt lookup, side by side in one process on the q8 default target: plain decoding
(`none`), `ngram` as it runs now (drafts seen first, acceptance kept per grade) and `ngram` under
the previous policy (one α per row, γ chosen before drafting), and every layer in one kernel call
against a call a layer. Prompts and methods interleaved, order flipped every repeat; each call
counts by its median repeat. Greedy texts are checked equal across methods.

Also: how often prompt lookup's first draft token is followed, by the length of the n-gram it
matched (its grade), over plain decoding's own answers (the numbers behind the grades).

Usage: OUT_JSON=out.json PYTHONPATH=. python scripts/ngram_grades_ab.py --per-category 8 \
    --max-new-tokens 128 --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import speculant
from speculant.bench.costs import bench_prompts
from speculant.bench.machine import what_ran
from speculant.drafters import make_drafter
from speculant.drafters.ngram import NgramDrafter
from speculant.models import fast as fast_module
from ab_common import save_results


class UngradedNgram(NgramDrafter):
    """The previous policy: no grades, so γ auto picks one γ from one α per row before drafting."""

    free_drafts = False

    def propose(self, gamma):
        prop = super().propose(gamma)
        prop.grades = None
        return prop


def grade_acceptance(prompts: list[list[int]], answers: list[list[int]], gamma: int = 15) -> dict:
    """Replays prompt lookup over plain decoding's greedy answers (the text any drafter yields):
    per grade, how many drafts, how often the first token was followed, mean tokens accepted."""
    stats = defaultdict(lambda: [0, 0, 0])
    for prompt, answer in zip(prompts, answers):
        d = NgramDrafter()
        d.start(type("Ctx", (), {"device": torch.device("cpu"), "prompts": [prompt]})())
        t = 0
        while t < len(answer) - 1:
            draft, grade = d._lookup(0, gamma)
            n = 0
            while n < len(draft) and t + n < len(answer) and draft[n] == answer[t + n]:
                n += 1
            if draft:
                s = stats[grade]
                s[0], s[1], s[2] = s[0] + 1, s[1] + (n > 0), s[2] + n
            d._extend(0, answer[t : t + n + 1])
            t += n + 1
    return {g: {"drafts": a, "first_followed": b / a, "mean_accepted": c / a} for g, (a, b, c) in sorted(stats.items())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    gen = speculant.load("default", drafter="none", dtype="q8")
    target = gen.target
    drafters = {"none": make_drafter("none", target), "ngram": make_drafter("ngram", target),
                "ngram (one α, γ before drafting)": UngradedNgram()}
    gens = {m: speculant.Generator(target, d, gamma=None if m == "none" else "auto") for m, d in drafters.items()}
    kernel_set = gens["none"].backend.fast.pass_set if hasattr(gens["none"].backend, "fast") else None
    one_call = getattr(kernel_set, "all_layers", None)
    prompts = [(cat, gen.encode(p)) for cat, p in bench_prompts(args.per_category)]
    for g in gens.values():
        g.generate_ids([prompts[0][1]], max_new_tokens=16)  # warm-up: the controller times its widths

    methods = list(gens) + (["none (a call a layer)"] if one_call is not None else [])
    times, texts = defaultdict(list), {}
    for r in range(args.repeats):
        for i, (cat, ids) in enumerate(prompts):
            for m in methods if r % 2 == 0 else methods[::-1]:
                g = gens["none"] if m == "none (a call a layer)" else gens[m]
                if kernel_set is not None:
                    kernel_set.all_layers = None if m == "none (a call a layer)" else one_call
                t = time.perf_counter()
                out = g.generate_ids([ids], max_new_tokens=args.max_new_tokens)[0]
                times[(i, m)].append(time.perf_counter() - t)
                texts.setdefault(i, out.token_ids)
                assert out.token_ids == texts[i], f"{m} parted from plain decoding on prompt {i}"
    per_cat = defaultdict(lambda: defaultdict(float))
    for i, (cat, _) in enumerate(prompts):
        for m in methods:
            per_cat[cat][m] += statistics.median(times[(i, m)])
            per_cat["all"][m] += statistics.median(times[(i, m)])
    results = {cat: {m: {"seconds": s, "vs_none": v["none"] / s} for m, s in v.items()} for cat, v in per_cat.items()}
    for cat, v in results.items():
        print(f"{cat:20s}", "  ".join(f"{m} {x['vs_none']:.3f}x" for m, x in v.items() if m != "none"), flush=True)
    grades = grade_acceptance([ids for _, ids in prompts], [texts[i] for i in range(len(prompts))])
    for g, s in grades.items():
        print(f"grade {g}: {s['drafts']} drafts, first token followed {s['first_followed']:.2f}, "
              f"{s['mean_accepted']:.2f} accepted", flush=True)
    save_results(results, grades=grades, ran={m: what_ran(g) for m, g in gens.items()}, settings=vars(args))


if __name__ == "__main__":
    main()
