"""One pass of the default target on the CPU fast path, quantized weights beside bf16 and float32,
side by side in one process: ms per pass at widths 1-16 (a one-token step, verify blocks), best of
``--rounds`` x 10 after a warm-up, a 45-token context. And each quantized linear kernel of the
model alone (a layer's q/k/v, o, gate/up and down, the LM head) at the same widths, its weights hot
in the caches: µs and multiply-adds a second. And a prompt's prefill through those kernels beside
HF's dense float32 computation, by prompt length (where ``QUANTIZED_PREFILL_MAX`` comes from).
Saves JSON and a plot.

    python benchmarks/scripts/quantized_passes.py --out benchmarks/results/NAME
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from speculant.models import fast as fast_module
from speculant.models.fast import FastLlama
from speculant.models.loading import load_model

WIDTHS = (1, 2, 4, 8, 16)
PREFILL_MAX = fast_module.QUANTIZED_PREFILL_MAX


@torch.inference_mode()  # as the engine runs it (autograd on bf16 one-row matmuls costs seconds)
def passes(dtype: str, rounds: int) -> dict:
    fast = FastLlama(load_model("default", device="cpu", dtype=dtype).model)
    keys, values = fast.new_cache(1, 512)
    tokens = torch.randint(1000, (1, 60), generator=torch.Generator().manual_seed(0))
    fast.prefill(tokens[:, :40], keys, values)

    def step(w: int):
        at = torch.arange(45, 45 + w)[None]
        fast.forward(tokens[:, :w], at, at, keys, values)

    out = {}
    for w in WIDTHS:
        for _ in range(3):
            step(w)
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(10):
                step(w)
            best = min(best, (time.perf_counter() - t) / 10 * 1e3)
        out[w] = round(best, 2)
    result = {"kernels": fast.kernels, "ms_per_pass": out}
    if dtype == "quantized":
        result["linear_kernels"] = linear_kernels(fast, rounds)
        result["one_token_step_ms"] = step_parts(fast, step)
        result["prefill_ms"] = prefills(fast)
    return result


def prefills(fast: FastLlama) -> dict:
    """A prompt's prefill (last position's logits) by length through ``FastLlama.prefill``: as one block
    of the passes' quantized kernels (every length let through), and HF's dense float32 computation
    (none let through); best of 3."""
    out = {}
    try:
        for n in (25, 72, 128, 150, 300, 600):
            tokens = torch.randint(1000, (1, n), generator=torch.Generator().manual_seed(n))
            row = {}
            for name, most in (("quantized kernels", n), ("hf dense float32", 0)):
                fast_module.QUANTIZED_PREFILL_MAX = most
                fast.prefill(tokens, *fast.new_cache(1, 1024), last_only=True)
                best = float("inf")
                for _ in range(3):
                    keys, values = fast.new_cache(1, 1024)
                    t = time.perf_counter()
                    fast.prefill(tokens, keys, values, last_only=True)
                    best = min(best, time.perf_counter() - t)
                row[name] = round(best * 1e3, 1)
            out[n] = row
    finally:
        fast_module.QUANTIZED_PREFILL_MAX = PREFILL_MAX
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
            reps = 10 if name == "lm_head" else 100
            for _ in range(3):
                lin(x)
            best = float("inf")
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(reps):
                    lin(x)
                best = min(best, (time.perf_counter() - t) / reps)
            row[w] = {"us": round(best * 1e6, 1), "gmac_per_s": round(lin.out_features * lin.in_features * w / best / 1e9, 1)}
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {d: passes(d, a.rounds) for d in ("quantized", "bfloat16", "float32")}
    results["threads"] = torch.get_num_threads()
    for d in ("quantized", "bfloat16", "float32"):
        print(f"{d:10s} {results[d]['kernels']:40s} " + "  ".join(f"{w}: {ms:.1f}" for w, ms in results[d]["ms_per_pass"].items()))
    print("  one-token step, ms: " + ", ".join(f"{k} {v}" for k, v in results["quantized"]["one_token_step_ms"].items()))
    print("  prefill, ms: " + ", ".join(f"{n} tokens {r['quantized kernels']} vs {r['hf dense float32']}"
                                        for n, r in results["quantized"]["prefill_ms"].items()))
    for name, row in results["quantized"]["linear_kernels"].items():
        print(f"  {name:8s} {str(row['shape']):13s} " + "  ".join(f"{w}: {row[w]['us']:.0f} us ({row[w]['gmac_per_s']:.0f} GMAC/s)"
                                                                  for w in WIDTHS))
    (out / "passes.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in ("quantized", "bfloat16", "float32"):
        ax.plot(WIDTHS, [results[d]["ms_per_pass"][w] for w in WIDTHS], marker="o", label=d)
    ax.set_xlabel("tokens in the pass (verify width)")
    ax.set_ylabel("ms per pass")
    ax.set_title("default target, one pass on the CPU fast path")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "passes.png", dpi=120)


if __name__ == "__main__":
    main()
