"""Where a decoding pass's time goes outside the kernels, in situ: the default target in ``--dtype``
with each drafter of ``--methods`` on bench prompts (greedy, 64 tokens), every engine step's parts
timed with a clock around them (the target's pass kernel, the EAGLE head's chain kernel, drafting,
verifying, acceptance, the tree walks, the drafter's catch-up), per pass; the prompts' prefill is
left out. After a pass has streamed the weights (~100 MB through every cache) the Python and
PyTorch code of the bookkeeping runs cold: ``probe`` times a few small PyTorch calls hot, after a
pass, and after copying 1.5 / 24 / 100 MB.

    python scripts/pass_python_costs.py [--methods "none;ngram;eagle@2;eagle+ngram"] [--per-category 3]
        [--categories multi_turn_chat,code,question_answering] [--out F.json]

Run it against another revision's Python with ``PYTHONPATH=<a worktree of it>`` (an A/B of the
engine's code, alternated runs). Made benchmarks/results/cpu-AVX512BF16-2026-11-29-zen4-pass-python/ and
.../cpu-AVX512BF16-2026-11-29-zen4-chain-in-kernel/."""
import argparse
import collections
import json
import statistics
import time

import torch

import speculant
from speculant import engine, verify
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts
from speculant.drafters import eagle
from speculant.models import fast, quantized

PARTS = {  # (owner, attribute): what the report calls it
    (engine.Engine, "_draft"): "draft (all)", (engine.Engine, "_verify"): "verify (all)",
    (engine.Engine, "_catch_up"): "drafter catch-up", (engine.Engine, "_account"): "account",
    (engine.Engine, "_room"): "room", (engine.Engine, "_decide"): "decide (scores, acceptance)",
    (fast.StaticKVState, "keep_path"): "tree: keep path", (eagle.EagleDrafter, "_unfed_block"): "eagle: unfed pairs",
    (eagle.EagleDrafter, "_best_first"): "eagle: best first", (eagle.KernelLayers, "chain"): "eagle: chain call",
}
FUNCTIONS = {"_accept": "acceptance", "block_layout": "tree: block layout", "path_block_index": "tree: path index"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="none;ngram;eagle@2;eagle+ngram")
    p.add_argument("--dtype", default="q8")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--categories", default="multi_turn_chat,code,question_answering")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    by_cat = collections.defaultdict(list)
    for bp in read_prompts():
        by_cat[bp.category].append(bp.prompt)
    prompts = [x for c in a.categories.split(",") for x in by_cat[c][: a.per_category]]
    seconds, calls, in_prefill = collections.defaultdict(float), collections.Counter(), [False]

    def timed(fn, label):
        def call(*args, **kw):
            if in_prefill[0]:
                return fn(*args, **kw)
            t = time.perf_counter()
            out = fn(*args, **kw)
            seconds[label] += time.perf_counter() - t
            calls[label] += 1
            return out
        return call

    k = quantized.kernels()
    k.run_pass, k.eagle_chain = timed(k.run_pass, "kernel: target pass"), timed(k.eagle_chain, "kernel: head chain")
    for (owner, name), label in PARTS.items():
        setattr(owner, name, timed(getattr(owner, name), label))
    for name, label in FUNCTIONS.items():
        setattr(engine, name, timed(getattr(engine, name), label))
    prefill = fast.FastLlama.prefill

    def untimed_prefill(self, *args, **kw):
        in_prefill[0] = True
        try:
            return prefill(self, *args, **kw)
        finally:
            in_prefill[0] = False
    fast.FastLlama.prefill = untimed_prefill

    results = {}
    for method in a.methods.split(";"):
        drafter, _, gamma = method.partition("@")
        gen = speculant.load("default", drafter=drafter, dtype=a.dtype, gamma=int(gamma) if gamma else None)
        ids = [gen.encode(x) for x in prompts]
        gen.generate_ids([ids[0]], max_new_tokens=16)
        runs = []
        for _ in range(a.repeats):
            seconds.clear(), calls.clear()
            t0, tokens = time.perf_counter(), 0
            for i in ids:
                out = gen.generate_ids([i], max_new_tokens=64)[0]
                tokens += len(out.token_ids)
            wall = time.perf_counter() - t0
            passes = calls["verify (all)"]
            per = {label: round(s / passes * 1e3, 4) for label, s in sorted(seconds.items())}
            kernels = seconds["kernel: target pass"] + seconds["kernel: head chain"]
            steps = sum(seconds[x] for x in ("draft (all)", "verify (all)", "drafter catch-up", "account", "room"))
            per["engine outside the kernels"] = round((steps - kernels) / passes * 1e3, 4)
            runs.append({"passes": passes, "tokens": tokens, "wall_s": round(wall, 4), "ms_per_pass": per})
        results[method] = runs
        last = runs[-1]["ms_per_pass"]
        print(f"{method:14s} passes {runs[-1]['passes']:4d}  target pass {last.get('kernel: target pass', 0):.3f} ms  "
              f"head chain {last.get('kernel: head chain', 0):.3f}  engine outside the kernels "
              f"{last['engine outside the kernels']:.3f}  acceptance {last.get('acceptance', 0):.3f}", flush=True)
    probe_results = probe()
    print("probe (70 small PyTorch calls, us):", probe_results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "machine": machine_info(), "greedy_accept_kernel":
                       getattr(verify, "_compiled_greedy_accept", None) is not None, "results": results,
                       "probe_us": probe_results}, f, indent=1)


def probe() -> dict:
    """70 small PyTorch calls (a greedy walk's kind) hot, right after a one-token q8 pass, and after
    copying buffers of 1.5 MB (this CPU's L2 and more), 24 and 100 MB: medians of 30, in us."""
    from speculant.drafters.registry import make_drafter
    from speculant.models.loading import load_model

    target = load_model("default", device="cpu", dtype="q8")
    f = speculant.Generator(target, make_drafter("none", target)).backend.fast
    keys, values = f.new_cache(1, 128)
    g = torch.Generator().manual_seed(0)
    f.prefill(torch.randint(0, 40000, (1, 100), generator=g), keys, values, last_only=True)
    a, b, n = torch.tensor([[5, 7]]), torch.tensor([[5, 8, 9]]), torch.tensor([2])
    big, copy = torch.empty(100 << 20, dtype=torch.uint8), torch.empty(100 << 20, dtype=torch.uint8)

    def calls() -> float:
        t = time.perf_counter()
        for _ in range(10):
            ok = (a == b[:, :2]) & (torch.arange(2)[None] < n[:, None])
            torch.cat([a, ok.cumprod(1).sum(1)[:, None]], 1).tolist()
        return time.perf_counter() - t

    times = collections.defaultdict(list)
    for _ in range(30):
        pos = torch.tensor([[100]])
        f.forward(torch.randint(0, 40000, (1, 1), generator=g), pos, pos, keys, values)
        times["after a pass"].append(calls())
        times["hot"].append(calls())
        for mb in (1.5, 24, 100):
            calls()
            copy[: int(mb * (1 << 20))].copy_(big[: int(mb * (1 << 20))])
            times[f"after copying {mb} MB"].append(calls())
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}


if __name__ == "__main__":
    main()
