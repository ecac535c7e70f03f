"""A q8 pass by width, this tree's CPU kernels beside a git revision's (``--base``), alternated in
one process: the default target's 30 decoder layers in one call (``run_layers``) and its LM head,
for blocks of 1-8 rows after a context of ``--context`` tokens; the median and best of ``--rounds``,
and whether both builds give every row the same bits. ``--prompts``: instead, the layers over
prompts of these lengths from position 0 (a prefill's block, as ``FastLlama.prefill`` runs it in q8).
``--base-flags``: the base is this tree built with these compiler flags on top (``-mno-amx-tile,-mno-amx-int8``:
this tree without its AMX tiles), not a revision. ``--run N``: each build takes N passes in a row before
the other's (each timed): a pass finds the caches as the pass before left them, so a change to what
stays cached (a prefetch's locality) shows only in runs: alternated pass by pass, a build whose
non-temporal prefetches left a 1.5k-token cache out of the Xeon's L3 made the other's next pass read
it from memory too (the attention's prefetch change, 2026-11-30: one row level pass by pass, 5 % apart
in runs of 20).

    python scripts/q8_widths_ab.py --base REV [--context 60] [--widths 1,2,3,4,5,8] [--rounds 15] [--run 1] [--out F.json]
    python scripts/q8_widths_ab.py --base REV --prompts 100,500,1500 [--rounds 11] [--out F.json]
    python scripts/q8_widths_ab.py --base-flags=-mno-amx-tile,-mno-amx-int8 --widths 8,9,12,16
"""
import argparse
import json
import statistics
import time

import torch

import speculant
from ab_common import base_kernels
from speculant.bench.machine import machine_info
from speculant.drafters.registry import make_drafter
from speculant.models import invariant, native
from speculant.models.fast import _NO_SLOTS, BoundLayers
from speculant.models.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="a git revision")
    base.add_argument("--base-flags", help="comma-separated compiler flags: this tree built with them as the base")
    p.add_argument("--context", type=int, default=60)
    p.add_argument("--widths", default="1,2,3,4,5,8")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--run", type=int, default=1, help="passes each build takes in a row (a width's)")
    p.add_argument("--prompts", help="prompt lengths: time the layers over a prompt's block instead")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    widths = [int(w) for w in a.widths.split(",")]
    target = load_model("default", device="cpu", dtype="q8")
    fast = speculant.Generator(target, make_drafter("none", target)).backend.fast
    if a.base_flags:
        a.base = f"flags {a.base_flags}"
        builds = {"this tree": native.build(), a.base: native.build(tuple(a.base_flags.split(",")))}
    else:
        builds = {"this tree": native.build(), a.base: base_kernels(a.base)}
    if builds[a.base] is None:
        raise SystemExit(f"q8_widths_ab: no kernels for the base ({a.base}): see the build's error above")
    norms, linears, bits = BoundLayers.weights(fast.pass_set.layers)
    handles = {name: m.bind_layers(norms, fast.eps, linears, bits, fast.n_heads, fast.n_kv, fast.head_dim)
               for name, m in builds.items()}
    if a.prompts:
        return prompts(a, fast, builds, handles)
    head = fast.pass_set.head.fn
    keys, values = fast.new_cache(1, a.context + max(widths) + 8)
    g = torch.Generator().manual_seed(0)
    fast.prefill(torch.randint(0, 40000, (1, a.context), generator=g), keys, values, last_only=True)
    times, outs = {}, {}
    for _ in range(a.rounds):
        for w in widths:
            pos = a.context + torch.arange(w)[None]
            h = fast.embed(torch.randint(0, 40000, (1, w), generator=g))
            cos, sin = fast.rotary(pos, a.context + w)
            count = invariant.key_layout(pos + 1, fast.dtype).count
            for name, m in builds.items():
                for _ in range(a.run):
                    t0 = time.perf_counter()
                    y, _ = m.run_layers(handles[name], h, cos, sin, keys, values, pos, _NO_SLOTS, count, fast.scaling,
                                        [])
                    t1 = time.perf_counter()
                    logits = m.quant_linear(y.view(w, -1), head.args, head.weight.bits)
                    times.setdefault((name, w), []).append((t1 - t0, time.perf_counter() - t1))
                outs[(name, w)] = logits
    results = {}
    for w in widths:
        for name in builds:
            layers, lm_head = zip(*times[(name, w)])
            results[f"{name} | {w} rows"] = {
                "layers_ms": {"median": round(statistics.median(layers) * 1e3, 3), "best": round(min(layers) * 1e3, 3)},
                "lm_head_ms": {"median": round(statistics.median(lm_head) * 1e3, 3), "best": round(min(lm_head) * 1e3, 3)}}
            r = results[f"{name} | {w} rows"]
            print(f"{w} rows  {name:12s} layers {r['layers_ms']['median']:.3f} (best {r['layers_ms']['best']:.3f})  "
                  f"LM head {r['lm_head_ms']['median']:.3f} (best {r['lm_head_ms']['best']:.3f}) ms", flush=True)
    same = all(torch.equal(outs[("this tree", w)], outs[(a.base, w)]) for w in widths)
    print("same bits:", same)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "same_bits": same, "results": results}, f, indent=1)


def prompts(a, fast, builds: dict, handles: dict) -> None:
    """The 30 layers over each prompt length's block from position 0 (the LM head left out: a prefill
    asks it for the last row only), the builds alternated; medians and best of ``--rounds``."""
    g = torch.Generator().manual_seed(0)
    results, same = {}, True
    for n in [int(x) for x in a.prompts.split(",")]:
        keys, values = fast.new_cache(1, n + 8)
        pos = torch.arange(n)[None]
        h = fast.embed(torch.randint(0, 40000, (1, n), generator=g))
        cos, sin = fast.rotary(pos, n)
        count = invariant.key_layout(pos + 1, fast.dtype).count
        times, outs = {name: [] for name in builds}, {}
        for _ in range(a.rounds):
            for name, m in builds.items():
                t0 = time.perf_counter()
                outs[name], _ = m.run_layers(handles[name], h, cos, sin, keys, values, pos, _NO_SLOTS, count,
                                             fast.scaling, [])
                times[name].append(time.perf_counter() - t0)
        same &= torch.equal(*outs.values())
        for name in builds:
            r = results[f"{name} | prompt of {n}"] = {"layers_ms": {"median": round(statistics.median(times[name]) * 1e3, 1),
                                                                    "best": round(min(times[name]) * 1e3, 1)}}
            print(f"prompt of {n:5d}  {name:12s} layers {r['layers_ms']['median']:.1f} (best {r['layers_ms']['best']:.1f}) ms",
                  flush=True)
    print("same bits:", same)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "same_bits": same, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
