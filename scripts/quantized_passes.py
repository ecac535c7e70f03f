"""One pass of the default target on the CPU fast path in each numeric mode, side by side in one
process: ms per pass at widths 1-16 (a one-token step, verify blocks) and what each row past the
first costs (a share of a one-row pass), best of ``--rounds`` x 10 after a warm-up (the widths in
turn within a round), a 45-token context. For the kernel modes (q8: int8 activations, quantized:
float32 activations) also: each linear kernel of the model alone (a layer's q/k/v, o, gate/up and
down, the LM head) at the same widths, its weights hot in the caches (µs and multiply-adds a
second); where a one-token step's time goes (its kernel calls and the rest, as one call and as the
calls it replaces); and a prompt's prefill by length (the kernels against HF's dense float32
computation; float32 is the model's own weights on the kernel core, ``float32:onednn`` on oneDNN's
packed copies). ``$SPECULANT_CPU_ISA=avx2`` measures the AVX2 branch of the kernels on an AVX-512 CPU
(pair it with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` for PyTorch's and oneDNN's).
Saves JSON and a plot.

    python scripts/quantized_passes.py --out benchmarks/results/NAME [--modes q8,quantized,float32,float32:onednn]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from speculant.bench.machine import machine_info
from speculant.models import fast as fast_module, quantized
from speculant.models.fast import FastLlama
from speculant.models.loading import load_model

WIDTHS = (1, 2, 3, 4, 5, 8, 16)
PREFILL_MAX = fast_module.QUANTIZED_PREFILL_MAX, fast_module.DENSE_PREFILL_MAX
KERNEL_MODES = ("q8", "quantized", "float32")  # float32: its own weights on the kernel core


def best_ms(fn, rounds: int, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


@torch.inference_mode()  # as the engine runs it (autograd on bf16 one-row matmuls costs seconds)
def passes(mode: str, rounds: int) -> dict:
    dtype, *options = mode.split(":")  # float32:onednn: on oneDNN's packed copies, as before the core
    fast = FastLlama(load_model("default", device="cpu", dtype=dtype).model,
                     kernels="onednn" if "onednn" in options else None)
    keys, values = fast.new_cache(1, 512)
    tokens = torch.randint(1000, (1, 60), generator=torch.Generator().manual_seed(0))
    fast.prefill(tokens[:, :45], keys, values)

    def step(w: int):
        at = torch.arange(45, 45 + w)[None]
        fast.forward(tokens[:, :w], at, at, keys, values)

    # the widths in turn within each round (a slow spell of this machine then slows every width, not one)
    best = {w: float("inf") for w in WIDTHS}
    for w in WIDTHS:
        for _ in range(3):
            step(w)
    for _ in range(rounds):
        for w in WIDTHS:
            t = time.perf_counter()
            for _ in range(10):
                step(w)
            best[w] = min(best[w], (time.perf_counter() - t) / 10 * 1e3)
    out = {w: round(ms, 2) for w, ms in best.items()}
    extra = {w: round((out[w] - out[1]) / (w - 1) / out[1], 3) for w in WIDTHS if w > 1}
    result = {"kernels": fast.kernels, "ms_per_pass": out, "extra_row_share_of_one_row_pass": extra}
    if mode in KERNEL_MODES:
        result["linear_kernels"] = linear_kernels(fast, rounds)
        result["one_token_step_ms"] = step_parts(fast, lambda: step(1), rounds)
        result["prefill_ms"] = prefills(fast, dtype)
    return result


def step_parts(fast: FastLlama, step, rounds: int) -> dict:
    """A one-token step's time and its part in the kernel calls (the rest: Python and PyTorch's small
    ops), as it runs (where the model's ends are bound, one ``run_pass`` call: "pass call") and as the
    calls it replaces (the layers, in one call or a call a layer; the LM head)."""
    mm = fast.pass_set
    bound = mm.all_layers() if mm.all_layers is not None else None
    cls = fast_module.BoundLayers
    spent = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return run

    def parts(whole: bool) -> dict:
        if bound is not None:
            bound.whole_passes = whole
        total = best_ms(step, rounds)
        spent.clear()
        saved = (cls.__call__, cls.run_pass, mm.layer_fn, mm.head)
        cls.__call__, cls.run_pass = timed("layers", cls.__call__), timed("pass call", cls.run_pass)
        mm.layer_fn, mm.head = timed("layers", mm.layer_fn), timed("lm_head", mm.head)  # a call a layer (bf16, float32)
        try:
            n = 50
            for _ in range(n):
                step()
        finally:
            cls.__call__, cls.run_pass, mm.layer_fn, mm.head = saved
        got = {k: round(v / n * 1e3, 2) for k, v in spent.items()}
        return {"total": round(total, 2), **got, "rest": round(max(0.0, total - sum(got.values())), 2)}

    whole = bound is not None and bound.whole_passes
    result = parts(whole)
    if whole:
        result["as_separate_calls"] = parts(False)
        bound.whole_passes = True
    return result


def prefills(fast: FastLlama, dtype: str) -> dict:
    """A prompt's prefill (last position's logits) by length through ``FastLlama.prefill``: as one block
    of the passes' kernels (every length let through; q8 always) and HF's dense float32 computation
    (none let through; quantized and float32 only); best of 3."""
    out = {}
    ways = (("kernels", 1 << 30),) + ((("hf dense float32", 0),) if dtype in ("quantized", "float32") else ())
    try:
        for n in (25, 128, 300, 600, 1500):
            tokens = torch.randint(1000, (1, n), generator=torch.Generator().manual_seed(n))
            row = {}
            for name, most in ways:
                fast_module.QUANTIZED_PREFILL_MAX = fast_module.DENSE_PREFILL_MAX = most
                best = float("inf")
                for _ in range(2 if n >= 600 else 3):
                    keys, values = fast.new_cache(1, 2048)
                    t = time.perf_counter()
                    fast.prefill(tokens, keys, values, last_only=True)
                    best = min(best, time.perf_counter() - t)
                row[name] = round(best * 1e3, 1)
            out[n] = row
    finally:
        fast_module.QUANTIZED_PREFILL_MAX, fast_module.DENSE_PREFILL_MAX = PREFILL_MAX
    return out


def linear_kernels(fast: FastLlama, rounds: int) -> dict:
    """Each quantized linear alone, hot in the caches: µs per call by width, and GMAC/s."""
    q = fast.pass_set.layers[0]["quantized"]
    linears = {"qkv": q["qkv"], "o": q["o"], "gate_up": q["gateup"], "down": q["down"],
               "lm_head": fast.pass_set.head.fn}
    out = {}
    for name, lin in linears.items():
        row = {"shape": [lin.out_features, lin.in_features], "format_bits": lin.weight.bits}
        for w in WIDTHS:
            x = torch.randn(w, lin.in_features)
            us = best_ms(lambda: lin(x), rounds, 10 if name == "lm_head" else 100) * 1e3
            row[w] = {"us": round(us, 1), "gmac_per_s": round(lin.out_features * lin.in_features * w / us / 1e3, 1)}
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--modes", default="q8,quantized,bfloat16,float32")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    results = {"machine": machine_info(), "kernels_isa": quantized.kernels().isa(), "threads": torch.get_num_threads()}
    results |= {d: passes(d, a.rounds) for d in modes}
    for d in modes:
        print(f"{d:10s} {results[d]['kernels'][:60]:60s} " + "  ".join(f"{w}: {ms:.1f}" for w, ms in results[d]["ms_per_pass"].items()))
        print(f"{'':10s} each row past the first: " + "  ".join(f"{w}: {x:.0%}" for w, x in results[d]["extra_row_share_of_one_row_pass"].items()))
    for d in (m for m in modes if m in KERNEL_MODES):
        print(f"{d}: one-token step, ms: " + ", ".join(f"{k} {v}" for k, v in results[d]["one_token_step_ms"].items()))
        print(f"{d}: prefill, ms: " + ", ".join(f"{n} tokens {r}" for n, r in results[d]["prefill_ms"].items()))
        for name, row in results[d]["linear_kernels"].items():
            print(f"  {name:8s} {str(row['shape']):13s} " + "  ".join(f"{w}: {row[w]['us']:.0f} us ({row[w]['gmac_per_s']:.0f})"
                                                                      for w in WIDTHS))
    (out / "passes.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in modes:
        ax.plot(WIDTHS, [results[d]["ms_per_pass"][w] for w in WIDTHS], marker="o", label=d)
    ax.set_xlabel("tokens in the pass (verify width)")
    ax.set_ylabel("ms per pass")
    ax.set_title(f"default target, one pass on the CPU fast path ({results['kernels_isa']} kernels)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "passes.png", dpi=120)


if __name__ == "__main__":
    main()
