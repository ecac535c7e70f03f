"""``speculant bench``: compare HF generate, HF assisted generation and speculant on prompt suites."""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from ..drafters import DRAFTER_HELP
from ..errors import SpeculantError, check_writable
from ..models.loading import resolve_device, resolve_model_path
from . import peers
from .methods import AUTO, MethodRunner
from .metrics import mismatches, summarize
from .prompts import read_prompts, select_prompts
from .machine import device_label, machine_info
from .report import write_results
from .runner import BenchConfig, count_calls, plan, run_benchmark

QUICK_PER_CATEGORY, QUICK_MAX_NEW_TOKENS = 2, 32


def _drafter_list(value: str) -> list[str]:
    """Comma-separated drafter specs; ``cascade:A,B`` keeps its own comma."""
    items, out = [v.strip() for v in value.split(",") if v.strip()], []
    while items:
        item = items.pop(0)
        if item.startswith("cascade:") and "," not in item and items:
            item += "," + items.pop(0)
        out.append(item)
    if not out:
        raise argparse.ArgumentTypeError("--drafters: give a comma-separated list")
    return out


def _list(kind: str, parse):
    def convert(value: str):
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{kind}: give a comma-separated list")
        try:
            return [parse(v) for v in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{kind}: {e}") from None
    return convert


def _gamma(v: str):
    if v == AUTO:
        return AUTO
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"each γ must be an integer >= 1 or 'auto', got {v!r}")
    return int(v)


def _temperature(v: str) -> float:
    t = float(v)
    if t < 0:
        raise ValueError(f"temperatures must be >= 0, got {v!r}")
    return t


def _batch(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"batch sizes must be integers >= 1, got {v!r}")
    return int(v)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench", help="benchmark drafters against HF generate",
        description="Spec-Bench-style benchmark: HF generate, HF assisted generation and speculant on the same "
                    "prompts in one process; writes JSON, CSV, a markdown table and plots.")
    b.add_argument("--target", default="default", help="'default', a model folder, or a .gguf file")
    b.add_argument("--drafters", "--drafter", type=_drafter_list, default=["ngram"],
                   help=f"comma list of drafters ({DRAFTER_HELP}); HF generate and speculant none always run")
    b.add_argument("--gamma", type=_list("--gamma", _gamma), default=[AUTO],
                   help="γ values, e.g. 1,2,4,8,auto (auto = the adaptive controller, chosen each pass); several = a γ sweep")
    b.add_argument("--temperature", type=_list("--temperature", _temperature), default=[0.0],
                   help="temperatures, e.g. 0,0.7,1.0; several = a temperature sweep")
    b.add_argument("--batch-size", type=_list("--batch-size", _batch), default=[1],
                   help="batch sizes, e.g. 1,4,16,64 (meant for a GPU); several = a batch sweep")
    b.add_argument("--max-new-tokens", type=int, default=None, help=f"default 128 (--quick: {QUICK_MAX_NEW_TOKENS})")
    b.add_argument("--prompts", default=None, help="a .jsonl file, one {\"prompt\": ..., \"category\": ...} a line "
                                                   "(default: the shipped suite, 8 categories)")
    b.add_argument("--categories", type=_list("--categories", str), default=None, help="only these categories")
    b.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    b.add_argument("--repeats", type=int, default=None, help="measured runs of every call (default 1)")
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls per method and setting (default 1)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    b.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | quantized | q8 | auto (default on a "
                   "CPU: q8 for a .gguf the int8 kernels read directly, else float32; bfloat16 on GPU)")
    b.add_argument("--path", default="auto", choices=["auto", "fast", "general"],
                   help="speculant's forward: auto (fast where the architecture has one), fast (static cache; "
                        "layerskip then shares the target's cache), general")
    b.add_argument("--peers", nargs="?", const="auto", default="auto",
                   help="other runtimes on the same .gguf, side by side, greedy: auto (those installed: llama.cpp via "
                   "llama-cpp-python, openvino via openvino-genai, llama.cpp-draft: llama.cpp's own draft-model "
                   "speculation with the model: drafter, where its llama-speculative-simple is found; none unless "
                   "the target is a .gguf on the CPU) | none | a comma list")
    b.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text (base models)")
    b.add_argument("--out", default=None, help="results folder (default: bench-out/<machine>-<date>)")
    b.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_PER_CATEGORY} prompts per category, {QUICK_MAX_NEW_TOKENS} new tokens")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
    return b


def _peers(value: str, target: str, device: str | None, drafters: list[str] = ()) -> list[str]:
    """--peers: auto = the installed ones where they apply (a .gguf target on the CPU; llama.cpp's draft-model
    speculation with a model:FILE.gguf drafter), else a list."""
    if value == "none":
        return []
    if value == "auto":
        on_cpu = resolve_device(device).type == "cpu"
        drafting = any(d.startswith("model:") and d.endswith(".gguf") for d in drafters)
        found = [p for p in peers.installed() if p != "llama.cpp-draft" or drafting]
        return found if on_cpu and resolve_model_path(target).is_file() else []
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in peers.PEERS]
    if unknown:
        raise SpeculantError(f"unknown peer {unknown[0]!r}: use auto, none or a comma list of {', '.join(peers.PEERS)}")
    missing = [n for n in names if n not in peers.installed()]
    if missing:
        how = {"llama.cpp": "pip install llama-cpp-python", "openvino": "pip install openvino-genai",
               "llama.cpp-draft": f"build llama.cpp's llama-speculative-simple (docs/benchmarks.md) and put it on the "
                                  f"PATH or in ${peers.SPECULATIVE_ENV}"}[missing[0]]
        raise SpeculantError(f"peer {missing[0]!r} is not installed: {how}, or --peers none")
    return names


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "machine"


def cmd_bench(args) -> int:
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (
        QUICK_MAX_NEW_TOKENS if args.quick else 128)
    per_category = args.per_category if args.per_category is not None else (QUICK_PER_CATEGORY if args.quick else None)
    repeats = args.repeats if args.repeats is not None else 1
    for name, value, low in (("--max-new-tokens", max_new, 1), ("--repeats", repeats, 1), ("--warmup", args.warmup, 0)):
        if value < low:
            raise SpeculantError(f"{name} must be >= {low}, got {value}")
    prompts = select_prompts(read_prompts(args.prompts), args.categories, per_category)
    config = BenchConfig(
        target=args.target, drafters=list(dict.fromkeys(args.drafters)), gammas=list(dict.fromkeys(args.gamma)),
        temperatures=list(dict.fromkeys(args.temperature)), batch_sizes=list(dict.fromkeys(args.batch_size)),
        max_new_tokens=max_new, repeats=repeats, warmup=args.warmup, seed=args.seed,
        device=args.device, dtype=args.dtype, path=args.path, chat_template=not args.no_chat_template,
        peers=_peers(args.peers, args.target, args.device, args.drafters))
    plan(config)  # bad drafter specs fail before any model is loaded
    if args.out:
        check_writable(args.out)  # before minutes of generation, not when the results are written

    runner = MethodRunner(config.target, config.drafters, config.device, config.dtype,
                          chat_template=config.chat_template, path=config.path, peers=config.peers)
    config.hf = runner.hf
    machine = machine_info(runner.device)
    out_dir = Path(args.out) if args.out else Path("bench-out") / (
        f"{_slug(device_label(machine))}-{time.strftime('%Y%m%d-%H%M%S')}")
    total = count_calls(config, prompts, plan(config))
    print(f"speculant bench: {len(prompts)} prompts, {total} generate calls on {runner.device} "
          f"-> {out_dir}", file=sys.stderr)

    from tqdm import tqdm  # the progress bar: only once a bench runs

    with tqdm(total=total, desc="bench", unit="call", disable=args.no_progress, file=sys.stderr) as bar:
        records = run_benchmark(config, prompts, runner, progress=bar.update)
    summary = summarize(records)
    files = write_results(out_dir, config, prompts, records, summary, machine, runner.what_ran())
    print(files["markdown"].read_text())
    bad = mismatches(records)
    for m in bad:
        print(f"speculant bench: OUTPUT MISMATCH: {m['method']} (γ={m['gamma']}, batch {m['batch_size']}) "
              f"prompt {m['prompt_id']} [{m['category']}] differs from {m['reference']} at new token "
              f"{m['first_divergence']}: {m['reference_token']} vs {m['got_token']}", file=sys.stderr)
    print(f"speculant bench: results in {out_dir}/ ({', '.join(sorted(p.name for p in files.values()))})",
          file=sys.stderr)
    return 0
