"""The target's logit gap at each greedy mismatch a `speculant bench` run recorded (bf16 near-ties?):

  python scripts/bench_gaps.py benchmarks/results/RUN      # the largest |gap| per method

One plain forward (the run's dtype) over the prompt and HF generate's text up to the divergence;
the gap between HF's token and ours there. HF's own prompt lookup is skipped."""
import json
import sys

import torch

import speculant
from speculant.bench.metrics import greedy_reference


def main(run: str) -> None:
    r = json.load(open(f"{run}/results.json"))
    settings = r["settings"]
    gen = speculant.load(settings.get("target", "default"), drafter="none", device="cpu", dtype=settings.get("dtype"))
    prompts = {p["id"]: p["prompt"] for p in r["prompts"]}
    ref = greedy_reference(r["records"])
    worst: dict[str, float] = {}
    for m in r["mismatches"]:
        if m["method"] == "hf assisted ngram" or None in (m["reference_token"], m["got_token"]):
            continue  # HF's own, or texts of other lengths (one ended): no token pair to compare
        ids = gen.encode(prompts[m["prompt_id"]], settings.get("chat_template", True))
        with torch.no_grad():
            x = torch.tensor([ids + ref[m["prompt_id"]][: m["first_divergence"]]])
            logits = gen.target.model(x).logits[0, -1]
        gap = float(logits[m["reference_token"]].float() - logits[m["got_token"]].float())
        worst[m["method"]] = max(worst.get(m["method"], 0.0), abs(gap))
    print({k: round(v, 4) for k, v in worst.items()})


if __name__ == "__main__":
    main(sys.argv[1])
