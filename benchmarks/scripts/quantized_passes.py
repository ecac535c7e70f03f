"""One pass of the default target on the CPU fast path, quantized weights beside bf16 and float32,
side by side in one process: ms per pass at widths 1-16 (a one-token step, verify blocks), best of
``--rounds`` x 10 after a warm-up, a 45-token context. Saves JSON and a plot.

    python benchmarks/scripts/quantized_passes.py --out benchmarks/results/NAME
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from speculant.models.fast import FastLlama
from speculant.models.loading import load_model

WIDTHS = (1, 2, 4, 8, 16)


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
    return {"kernels": fast.kernels, "ms_per_pass": out}


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
