"""What the EAGLE head's proposal costs against a target pass, beside a q8 target (the shipped
head's chain in one kernel call: ``eagle_chain``). Two views, one process:

- in situ: the default target with ``eagle`` at fixed γ (1, 2, 4, 6) on bench prompts, greedy; the
  median time of the chain kernel, of the whole proposal (its Python included), and of the target's
  passes by width (its decoder layers in one call, and its LM head);
- hot: one captured proposal (a one-token catch-up) run again and again at 1, 2, 3 and 6 levels
  with no early stop (a level: one head step of one row and its 8 best draft tokens), min and median.

    python scripts/eagle_head_cost.py --out benchmarks/results/NAME [--prompts 8] [--repeats 2]

Made benchmarks/results/cpu-AVX2-2026-11-27-zen3-f16cache/eagle_head_cost.json."""
import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts
from speculant.drafters import eagle
from speculant.models import quantized

GAMMAS = (1, 2, 4, 6)
LEVELS = (1, 2, 3, 6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    a = p.parse_args()
    torch.set_num_threads(2)
    gen = speculant.load("default", drafter="eagle", dtype="q8")
    k = quantized.kernels()
    times, gamma, captured = collections.defaultdict(list), {"now": 0}, {}
    run_layers, quant_linear, chain = k.run_layers, k.quant_linear, k.eagle_chain

    def timed(fn, key):
        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            times[key(args)].append(time.perf_counter() - t)
            return out
        return call

    def capture(*args):  # a proposal of 6 levels after a one-token catch-up: the hot view's input
        if args[7] == 6 and args[0].shape[1] == 1 and "args" not in captured:
            captured["args"] = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        return chain(*args)

    k.run_layers = timed(run_layers, lambda args: ("target layers, rows", args[1].shape[1]))
    k.quant_linear = timed(quant_linear, lambda args: ("target LM head, rows", args[0].shape[0]))
    k.eagle_chain = timed(capture, lambda args: ("head chain kernel, gamma", gamma["now"]))
    propose = eagle.EagleDrafter._propose_chain
    eagle.EagleDrafter._propose_chain = lambda self, g: timed(
        lambda: propose(self, g), lambda _: ("head proposal, gamma", gamma["now"]))()
    prompts = [q.prompt for q in read_prompts()][:: max(1, len(read_prompts()) // a.prompts)][: a.prompts]
    gen.generate(prompts[0], max_new_tokens=16, temperature=0.0, gamma=2)  # warm
    times.clear()
    for _ in range(a.repeats):
        for g in GAMMAS:
            gamma["now"] = g
            for prompt in prompts:
                gen.generate(prompt, max_new_tokens=a.tokens, temperature=0.0, gamma=g)
    k.run_layers, k.quant_linear, k.eagle_chain = run_layers, quant_linear, chain
    in_situ = {f"{what} {n}": {"calls": len(v), "median_ms": round(statistics.median(v) * 1e3, 3)}
               for (what, n), v in sorted(times.items()) if len(v) >= 20}  # prefills and rare widths left out
    hot = {}
    args = captured["args"]
    for _ in range(30):
        for levels in LEVELS:
            b = list(args)
            b[7], b[13] = levels, 0.0  # levels; min_score 0: no early stop
            t = time.perf_counter()
            chain(*b)
            hot.setdefault(levels, []).append(time.perf_counter() - t)
    hot = {f"{levels} levels": {"min_ms": round(min(v) * 1e3, 3), "median_ms": round(statistics.median(v) * 1e3, 3)}
           for levels, v in hot.items()}
    for key, v in {**in_situ, **hot}.items():
        print(f"{key:32s} {v}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eagle_head_cost.json").write_text(json.dumps(
        {"args": vars(a), "machine": machine_info(), "in_situ": in_situ, "hot_chain": hot}, indent=1))


if __name__ == "__main__":
    main()
