"""Which part of the forward is not width-invariant on this GPU (float32 failed the whole-forward
proof on an H200): each kernel of FastLlama's pass alone, rows of widths 1..64 against one-row calls,
on SmolLM2-135M's shapes with random weights.

    python scripts/gpu_invariance_parts.py --dtype float32 --out parts.json
"""
import argparse
import json
from pathlib import Path

import torch

from gpu_invariance import smol  # its sibling script (run as a script, this folder is on sys.path)
from speculant.bench.machine import machine_info
from speculant.models import invariant
from speculant.models.fast import FastLlama, _rms_norm


def rows_equal(fn, x, widths=(1, 2, 3, 5, 8, 13, 16, 17, 32, 33, 64)):
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    return {m: bool(torch.equal(fn(x[:m]), alone[:m])) for m in widths}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="parts.json")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = smol(dtype, torch.device(dev))
    fast = FastLlama(model)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 576, generator=g) * 2).to(dev, dtype)
    w = fast.pass_set.layers[0]
    res = {"machine": machine_info(dev), "kernels": fast.invariance, "proof": fast.proves_invariance()}
    res["rms_norm"] = rows_equal(lambda t: _rms_norm(t, w["ln1"], fast.eps), x)
    res["rms_norm 3d"] = rows_equal(lambda t: _rms_norm(t[None], w["ln1"], fast.eps)[0], x)
    for name, fn in w.items():
        if name.endswith("_packed"):
            inp = x if fn.fn.in_features == 576 else (torch.randn(64, fn.fn.in_features, generator=g) * 2).to(dev, dtype)
            res[name] = rows_equal(fn, inp)
    res["head"] = rows_equal(fast.pass_set.head, x)
    res["silu*up"] = rows_equal(lambda t: torch.nn.functional.silu(t) * t, x)
    pos = torch.arange(64, device=dev)[None]
    emb = torch.cat([pos[..., None].float() * fast.inv_freq.float()] * 2, -1)
    res["rotary"] = bool(torch.equal(emb.cos()[0, 5], (torch.cat([pos[:, 5:6, None].float() * fast.inv_freq.float()] * 2, -1)).cos()[0, 0]))
    res["attention check"] = invariant.attention_holds(fast.attention, dtype, 9, 3, 64, dev)
    for k, v in res.items():
        print(k, v if not isinstance(v, dict) or not all(isinstance(b, bool) for b in v.values())
              else ("all equal" if all(v.values()) else {m: b for m, b in v.items() if not b}), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
