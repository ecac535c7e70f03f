"""Where a plain-decoding pass of the default target goes in float32 and bfloat16 on the fast path
(PyTorch's matmuls: oneDNN packs or F.linear, whichever ``cpu_kernels.plan`` chose on this CPU):
the linears (``RowLinear`` calls, the LM head included), the RMS norms, the attention kernel, and the
rest of the forward (rotary, residuals, SiLU, Python); and the LM head alone at one row. Greedy, one
bench prompt, 2 threads, the passes' mean with the prefill included.

    python scripts/float_step_breakdown.py --out benchmarks/results/NAME [--dtypes float32,bfloat16]

Made benchmarks/results/cpu-AVX2-2026-11-27-zen3-f16cache/float_step_breakdown.json."""
import argparse
import collections
import functools
import json
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts
from speculant.models import fast, invariant

PARTS = {"linears": (invariant.RowLinear, "__call__"), "norms": (fast, "_rms_norm"),
         "attention": (fast.PassAttention, "__call__"), "forward": (fast.FastLlama, "forward")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=48)
    a = p.parse_args()
    torch.set_num_threads(2)
    spent = collections.Counter()
    for part, (owner, name) in PARTS.items():
        def timed(fn, part=part):
            @functools.wraps(fn)
            def call(*args, **kw):
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    spent[part] += time.perf_counter() - t
            return call
        setattr(owner, name, timed(getattr(owner, name)))
    prompt, results = read_prompts()[0].prompt, {}
    for dtype in a.dtypes.split(","):
        gen = speculant.load("default", drafter="none", dtype=dtype)
        model = gen.backend.fast
        gen.generate(prompt, max_new_tokens=8, temperature=0.0)  # warm
        spent.clear()
        t = time.perf_counter()
        passes = gen.generate(prompt, max_new_tokens=a.tokens, temperature=0.0).stats["target_forward_passes"]
        seconds = time.perf_counter() - t
        x = torch.randn(1, 1, model.lm_head.weight.shape[1], dtype=model.dtype)
        head = []
        for _ in range(10):
            t = time.perf_counter()
            model.pass_set.head(x)
            head.append(time.perf_counter() - t)
        ms = {part: round(v / passes * 1e3, 2) for part, v in spent.items()}
        ms["rest of the forward"] = round(ms["forward"] - ms["linears"] - ms["norms"] - ms["attention"], 2)
        results[dtype] = {"kernels": model.kernels, "passes": passes, "ms_per_pass": round(seconds / passes * 1e3, 2),
                          "parts_ms_per_pass": ms, "lm_head_alone_ms": round(min(head) * 1e3, 2),
                          "weight_bytes": sum(t.numel() * t.element_size() for t in gen.target.model.parameters())}
        print(dtype, json.dumps(results[dtype]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float_step_breakdown.json").write_text(json.dumps({"args": vars(a), "machine": machine_info(),
                                                               "dtypes": results}, indent=1))


if __name__ == "__main__":
    main()
