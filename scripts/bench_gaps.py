"""The target's logit gap at each greedy mismatch a `speculant bench` run recorded (bf16 near-ties?):

  python scripts/bench_gaps.py benchmarks/results/RUN      # the largest |gap| per method

One plain forward (the run's dtype) over the prompt and HF generate's text up to the divergence;
the gap between HF's token and ours there. HF's own prompt lookup is skipped."""
import json
import sys

import torch

from speculant.models.loading import load_model
from speculant.trained.data import encode_prompt


def main(run: str) -> None:
    r = json.load(open(f"{run}/results.json"))
    target = load_model(r["settings"].get("target", "default"), device="cpu", dtype=r["settings"].get("dtype"))
    prompts = {p["id"]: p["prompt"] for p in r["prompts"]}
    ref = {row["prompt_id"]: row["token_ids"] for rec in r["records"] if rec["method"] == "hf generate"
           for row in rec["rows"]}
    worst: dict[str, float] = {}
    for m in r["mismatches"]:
        if m["method"] == "hf assisted ngram":
            continue
        ids = encode_prompt(target.tokenizer, prompts[m["prompt_id"]], 10**6)
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + ref[m["prompt_id"]][: m["first_divergence"]]])).logits[0, -1]
        gap = float(logits[m["reference_token"]].float() - logits[m["got_token"]].float())
        worst[m["method"]] = max(worst.get(m["method"], 0.0), abs(gap))
    print({k: round(v, 4) for k, v in worst.items()})


if __name__ == "__main__":
    main(sys.argv[1])
