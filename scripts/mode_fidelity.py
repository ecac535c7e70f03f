"""How far each CPU numeric mode's model is from float32's, on held text: perplexity of the default
target (SmolLM2-135M-Instruct, its Q4_1 GGUF) on ShareGPT assistant replies, per mode, side by side.

- float32: HF's forward over the dequantised weights (the reference);
- bfloat16: HF's forward in bfloat16;
- quantized: float32 activations over the GGUF's own blocks, through speculant's kernels;
- q8: int8 activations (each row quantized in blocks of 32) over the same blocks.
The kernel modes run ``FastLlama.forward`` in blocks of 64 tokens, where each row is computed alone:
a token's logits are exactly those plain decoding in that mode computes. Conversations are taken
from the end of the ShareGPT file (after the first 10,000 of its 11,139 that start with a user turn; the
shipped EAGLE head trained on its first ones). Saves JSON.

    python scripts/mode_fidelity.py --out benchmarks/results/NAME [--modes q8]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from speculant.models.fast import FastLlama
from speculant.models.loading import load_model
from speculant.trained.data import sharegpt_conversations

MODES = ("float32", "bfloat16", "quantized", "q8")


def held_texts(tokenizer, count: int, skip: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(token ids, where the assistant's reply starts) of ``count`` first exchanges after ``skip``."""
    out = []
    for i, conv in enumerate(sharegpt_conversations(skip + 4 * count)):
        if i < skip or len(conv) < 2 or conv[1]["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(conv[:1], add_generation_prompt=True)
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        reply = tokenizer(conv[1]["content"], add_special_tokens=False)["input_ids"]
        ids = (prompt + reply)[:max_tokens]
        if len(prompt) < 256 and len(ids) - len(prompt) >= 32:
            out.append((ids, len(prompt)))
        if len(out) == count:
            break
    return out


@torch.inference_mode()
def logits_of(mode: str, lm, ids: list[int]) -> torch.Tensor:
    toks = torch.tensor([ids])
    if mode in ("float32", "bfloat16"):
        return lm.model(toks).logits[0].float()
    fast = FastLlama(lm.model)
    keys, values = fast.new_cache(1, len(ids) + 8)
    parts = []
    for s in range(0, len(ids), 64):
        at = torch.arange(s, min(s + 64, len(ids)))[None]
        parts.append(fast.forward(toks[:, s : s + 64], at, at, keys, values)[0])
    return torch.cat(parts).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--texts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES), help="float32 (the reference) always runs")
    a = ap.parse_args()
    modes = ["float32"] + [m for m in a.modes.split(",") if m != "float32"]
    if unknown := set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(unknown)} (of {', '.join(MODES)})")
    torch.set_num_threads(2)
    tok = load_model("default", device="cpu", dtype="float32").tokenizer
    texts = held_texts(tok, a.texts, 10_000, a.max_tokens)
    results = {"model": "SmolLM2-135M-Instruct Q4_1 GGUF", "texts": len(texts),
               "scored_tokens": sum(len(i) - s for i, s in texts), "modes": {}}
    top1 = {}
    for mode in modes:
        lm = load_model("default", device="cpu", dtype=mode)
        t, nll, count, picks = time.perf_counter(), 0.0, 0, []
        for ids, start in texts:
            logp = logits_of(mode, lm, ids).log_softmax(-1)
            target = torch.tensor(ids[start:])
            nll -= float(logp[start - 1 : -1].gather(1, target[:, None]).sum())
            count += len(target)
            picks.append(logp[start - 1 : -1].argmax(-1))
        top1[mode] = torch.cat(picks)
        results["modes"][mode] = {"mean_nll": round(nll / count, 5), "perplexity": round(math.exp(nll / count), 4),
                                  "seconds": round(time.perf_counter() - t, 1)}
        print(mode, results["modes"][mode], flush=True)
    ref = results["modes"]["float32"]["perplexity"]
    for mode, r in results["modes"].items():
        r["perplexity_vs_float32"] = round(r["perplexity"] / ref - 1, 5)
        r["argmax_agrees_with_float32"] = round(float((top1[mode] == top1["float32"]).float().mean()), 5)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mode_fidelity.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["modes"], indent=1))


if __name__ == "__main__":
    main()
