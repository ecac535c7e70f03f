"""``speculant tune-layerskip --target T``: choose which layers the self-speculative drafter skips.

Acceptance alone favours skipping nothing; speed favours skipping much. So each candidate skip set
is *timed*: greedy generation with the engine on a few calibration prompts, keeping the set with
the most tokens per second. Candidates: every other layer over a middle band (three widths), and
contiguous blocks in the middle and just before the last layer (early-exit-like). Then a small
greedy refinement around the winner (widen / narrow its band by one step). The winner is saved
as JSON, which ``layerskip`` loads for that target (or ``layerskip:FILE.json``).
"""
from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

from ..api import Generator
from ..drafters import NoDrafter
from ..drafters.layerskip import LayerSkipDrafter, num_layers, tuned_path
from .. import files
from ..errors import SpeculantError, check_writable
from ..models.loading import load_model

CALIBRATION_CATEGORIES = ("question_answering", "code", "summarization", "math_reasoning", "translation")


def candidate_skip_sets(n: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for margin in (max(1, n // 8), max(1, n // 5), max(1, n // 4), max(1, n // 3)):
        out[f"alternate {margin}..{n - 1 - margin}"] = list(range(margin, n - margin, 2))
    for size in (max(1, n // 5), max(1, n // 3)):
        lo = (n - size) // 2
        out[f"middle block {lo}..{lo + size - 1}"] = list(range(lo, lo + size))
        out[f"late block {n - 1 - size}..{n - 2}"] = list(range(n - 1 - size, n - 1))
    clean = {}
    for name, skip in out.items():
        skip = sorted(i for i in set(skip) if 0 < i < n - 1)
        if skip and skip not in clean.values():
            clean[name] = skip
    return clean


def calibration_prompts(count: int) -> list[str]:
    lines = resources.files("speculant.bench").joinpath("prompts/default.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    picked = []
    for cat in CALIBRATION_CATEGORIES:  # one per category, for variety
        picked += [r["prompt"] for r in rows if r.get("category") == cat][:1]
    return picked[:count]


def measure(gen, prompt_ids: list[list[int]], max_new_tokens: int, gamma: int) -> dict:
    """Greedy, one prompt at a time (the single-stream latency the drafter is for)."""
    tokens = seconds = drafted = accepted = passes = 0
    for ids in prompt_ids:
        t0 = time.perf_counter()
        out = gen.generate_ids([ids], max_new_tokens=max_new_tokens, gamma=gamma)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        drafted += out.stats["draft_tokens"]
        accepted += out.stats["accepted_draft_tokens"]
        passes += out.stats["target_forward_passes"]
    return {
        "tokens_per_second": round(tokens / seconds, 2),
        "acceptance_rate": round(accepted / max(drafted, 1), 4),
        "mean_accepted_tokens": round(tokens / max(passes, 1), 3),
    }


def tune(target_spec: str, prompts: int = 3, max_new_tokens: int = 48, gamma: int = 4, device=None, dtype=None,
         log=print) -> dict:
    target = load_model(target_spec, device=device, dtype=dtype)
    n = num_layers(target.model)
    if n < 3:
        raise SpeculantError(f"the target has {n} layers: layerskip needs at least 3 (the first and last always run)")
    texts = calibration_prompts(prompts)
    plain = Generator(target, NoDrafter())
    ids = [plain.encode(t) for t in texts]
    measure(plain, ids[:1], 8, 1)  # warm-up
    base = measure(plain, ids, max_new_tokens, 1)
    log(f"no drafter: {base['tokens_per_second']:.1f} tok/s")

    results: dict[tuple, dict] = {}

    def trial(name: str, skip: list[int]) -> dict:
        key = tuple(skip)
        if key not in results:
            gen = Generator(target, LayerSkipDrafter(target.model, skip, label=name), gamma)
            results[key] = measure(gen, ids, max_new_tokens, gamma) | {"skip_layers": list(skip), "name": name}
            r = results[key]
            log(f"{name:<24} skip {len(skip):>2}/{n}: {r['tokens_per_second']:6.1f} tok/s  "
                f"α={r['acceptance_rate']:.2f} τ={r['mean_accepted_tokens']:.2f}")
        return results[key]

    for name, skip in candidate_skip_sets(n).items():
        trial(name, skip)
    best = max(results.values(), key=lambda r: r["tokens_per_second"])
    # greedy refinement: drop or add one layer at either end of the winner's skip set
    for _ in range(2):
        skip = best["skip_layers"]
        lo, hi = skip[0], skip[-1]
        step = skip[1] - skip[0] if len(skip) > 1 else 1
        for cand in (skip[1:], skip[:-1], [lo - step] + skip, skip + [hi + step]):
            if cand and all(0 < i < n - 1 for i in cand):
                trial("refined", sorted(cand))
        new_best = max(results.values(), key=lambda r: r["tokens_per_second"])
        if new_best is best:
            break
        best = new_best
    return {
        "target": target_spec,
        "num_layers": n,
        "skip_layers": best["skip_layers"],
        "tokens_per_second": best["tokens_per_second"],
        "acceptance_rate": best["acceptance_rate"],
        "mean_accepted_tokens": best["mean_accepted_tokens"],
        "baseline_tokens_per_second": base["tokens_per_second"],
        "gamma": gamma,
        "device": str(target.device),
        "trials": sorted(results.values(), key=lambda r: -r["tokens_per_second"]),
        "_target_name": target.name,
    }


def cmd_tune_layerskip(args) -> int:
    if args.gamma < 1:
        raise SpeculantError(f"--gamma must be >= 1, got {args.gamma}")
    if args.prompts < 1:
        raise SpeculantError(f"--prompts must be >= 1, got {args.prompts}")
    if args.max_new_tokens < 2:
        raise SpeculantError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    # where the result goes, checked before minutes of timing (the default: the cache's folder)
    if args.out and files.is_dir(files.as_path(args.out), "--out path"):
        raise SpeculantError(f"--out {files.shown(args.out)} is a folder: give the JSON file's path")
    check_writable(files.as_path(args.out) if args.out else tuned_path("x").parent, beside=bool(args.out))
    result = tune(args.target, args.prompts, args.max_new_tokens, args.gamma, args.device, args.dtype,
                  log=lambda s: print(s, flush=True))
    out = Path(args.out).expanduser() if args.out else tuned_path(result.pop("_target_name"))
    result.pop("_target_name", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"best: skip {result['skip_layers']} -> {result['tokens_per_second']:.1f} tok/s "
          f"(no drafter {result['baseline_tokens_per_second']:.1f}); saved {out}")
    return 0


def add_tune_layerskip_parser(sub) -> None:
    p = sub.add_parser("tune-layerskip", help="search the layers the layerskip drafter skips",
                       description="Time candidate skip sets on calibration prompts; save the fastest as JSON.")
    p.add_argument("--target", default="default", help="'default', a model folder, or a .gguf file")
    p.add_argument("--prompts", type=int, default=3, help="calibration prompts (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON path (default: the cache file `layerskip` loads for this target)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.set_defaults(func=cmd_tune_layerskip)
