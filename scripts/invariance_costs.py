"""What width invariance costs per kernel on this CPU, the default model's shapes (bf16): attention
(SDPA, the compiled per-query kernel, the PyTorch-ops modes) by keys and queries, the MLP's down
projection called with one row or padded to the two its window asks, and the one-time checks.

    python scripts/invariance_costs.py --out costs.json
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from speculant.bench.machine import machine_info
from speculant.models import cpu_attention, invariant
from speculant.models.cpu_kernels import PackedLinear, machine_key


def timed(fn, reps=200):
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return round((time.perf_counter() - t) / reps * 1e6, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="invariance-costs.json")
    a = ap.parse_args()
    dt, g = torch.bfloat16, torch.Generator().manual_seed(0)
    res = {"machine": machine_info(), "kernel_cache_key": machine_key(), "threads": torch.get_num_threads(), "attention_us": [], "linear_us": {}}
    modes = {"kernel": ("kernel", invariant.WIDE), "tiled": ("tiled", invariant.WIDE),
             "batched": ("batched", invariant.WIDE)}
    if cpu_attention.kernel() is None:
        modes.pop("kernel")
    k = torch.randn(1, 3, 2048, 64, generator=g).to(dt)
    v = torch.randn(1, 3, 2048, 64, generator=g).to(dt)
    for n, T in [(100, 1), (300, 1), (1000, 1), (300, 6), (300, 16), (1000, 16)]:
        q = torch.randn(1, 9, T, 64, generator=g).to(dt)
        lay = invariant.key_layout(torch.arange(n - T + 1, n + 1)[None], dt)
        row = {"keys": n, "queries": T,
               "sdpa": timed(lambda: F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=0.125,
                                                                    is_causal=T > 1, enable_gqa=True))}
        for name, mode in modes.items():
            att = invariant.Attention(mode, mode)
            row[name] = timed(lambda: att(q, k, v, lay, 0.125))
        res["attention_us"].append(row)
        print(row, flush=True)
    w = (torch.randn(576, 1536, generator=g) * 0.02).to(dt)
    down = PackedLinear(w, None, dt, 1)
    x1 = torch.randn(1, 1536, generator=g).to(dt)
    res["linear_us"]["down projection, 1 row"] = timed(lambda: down(x1), 1000)
    res["linear_us"]["down projection, padded to 2 rows (its window)"] = timed(
        lambda: invariant.Rows(2, 64)(down, x1), 1000)
    print(res["linear_us"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
