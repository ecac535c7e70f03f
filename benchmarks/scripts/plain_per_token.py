"""Plain decoding per token on the same GGUF: speculant's quantized path beside llama.cpp and
OpenVINO GenAI (those installed), one short chat prompt, greedy, 2 threads, one process.

For each runtime: the time to the first token (the prefill and the first token) and the mean time
of each later token, best of ``--rounds`` runs in a rotated order. The issue's plain-decoding
measure (ms/token, a short prompt, 128 tokens). Saves JSON.

    python benchmarks/scripts/plain_per_token.py --out benchmarks/results/NAME
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import speculant
from speculant.bench import peers
from speculant.drafters import make_drafter
from speculant.models.loading import default_model_path, load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(target):
    gen = speculant.Generator(target, make_drafter("none", target))

    def run(ids, n):
        return gen.generate_ids([ids], max_new_tokens=n)[0].token_ids
    return run


def peer(name: str):
    runner = peers.load(name, default_model_path(), 2048)
    return lambda ids, n: runner.generate(ids, n, set())  # no EOS: every runtime makes n tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    target = load_model("default", device="cpu", dtype="quantized")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    runtimes = {"speculant quantized": ours(target)}
    runtimes |= {name: peer(name) for name in ("llama.cpp", "openvino") if name in peers.installed()}
    best = {name: {"first_token_ms": float("inf"), "total_ms": float("inf")} for name in runtimes}
    made = {}
    for run in runtimes.values():  # warm-up
        run(ids, 8)
    names = list(runtimes)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            run = runtimes[name]
            t = time.perf_counter()
            run(ids, 1)
            first = time.perf_counter() - t
            t = time.perf_counter()
            made[name] = len(run(ids, a.tokens))
            total = time.perf_counter() - t
            best[name]["first_token_ms"] = min(best[name]["first_token_ms"], first * 1e3)
            best[name]["total_ms"] = min(best[name]["total_ms"], total * 1e3)
    results = {"prompt_tokens": len(ids), "threads": 2, "runtimes": {}}
    for name, b in best.items():
        per = (b["total_ms"] - b["first_token_ms"]) / (made[name] - 1)
        results["runtimes"][name] = {"tokens": made[name], "first_token_ms": round(b["first_token_ms"], 1),
                                     "ms_per_later_token": round(per, 2), "total_ms": round(b["total_ms"], 1)}
        print(f"{name:22s} first token {b['first_token_ms']:6.1f} ms   then {per:5.2f} ms/token   "
              f"{made[name]} tokens in {b['total_ms']:.0f} ms")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plain_per_token.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
